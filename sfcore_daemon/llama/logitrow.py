"""A numpy view of one row of llama.cpp's logits, without a copy: the argmax of a plain
greedy request (sampling.py) and a row's logprobs (logprobs.py) read it.

The view is made once per row address and kept: llama.cpp writes every step's rows into
the same output buffer, so the same few addresses come back step after step, and
`ctypeslib.as_array` would build a ctypes array type and a cast every token
(docs/performance/idle-slots.md). A view is only read at an address llama.cpp
has just returned for a whole row of that vocabulary: after the buffer moves, an old
address is never asked for again unless it is such a row again.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from sfcore_daemon.llama.capi import C

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# llama_get_logits_ith with the row's address as an int (the bindings' own prototype
# returns a float pointer).
_row_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
    ("llama_get_logits_ith", C._lib))
# By (address, n_vocab): a process may hold contexts of two models (tests, the tuner).
_views: dict[tuple[int, int], Any] = {}
_MOST_VIEWS = 4096  # a new output buffer (more draft rows) brings new addresses


def row_view(ctx: Any, row: int, n_vocab: int) -> npt.NDArray[np.float32]:
    """Output row `row` of `ctx`'s logits, `n_vocab` floats; RuntimeError when llama.cpp
    has none for it."""
    address = _row_address(ctx, row)
    if not address:
        raise RuntimeError(f"llama.cpp has no logits for row {row}")
    key = (address, n_vocab)
    view = _views.get(key)
    if view is None:
        import numpy  # imported beside the model load already (sampling.py)

        if len(_views) >= _MOST_VIEWS:
            _views.clear()
        floats = (ctypes.c_float * n_vocab).from_address(address)
        view = numpy.frombuffer(memoryview(floats), dtype=numpy.float32)
        _views[key] = view
    return view
