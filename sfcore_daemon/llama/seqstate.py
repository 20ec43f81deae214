"""The bytes of a llama.cpp sequence state (llama_state_seq_get_data), read as far as
the prompt store needs: a sliding-window model's state has two parts, its full-attention
layers' cells and then its window layers' cells, and `window_pad` builds a state of
window-layer cells alone that holds the window cache's first cells.

Why: a restored state puts its window rows at the first free cells of the window cache,
where a cold run of the same prompt has them a whole prompt further on. Attention sums
the cells in tiles and thread chunks by cell index, so the restored sequence then
computes other floats than the cold run, and its greedy text can drift from the cold
one. With the pad restored first, the window rows land at the cells the cold run uses,
and the two compute the same bytes (docs/performance/prompt-store.md).

The layout (llama-context.cpp, llama-kv-cache.cpp of the vendored llama.cpp): a magic
and the sequence id, then per cache part: the stream count and per stream its cell
count, each cell's position, seq-id count, optional cell extension and seq ids, then
`v_trans`, the layer count and for each layer the K rows (type, row size, rows), then
the V rows. Anything else (transposed V, several streams) gives None: no pad, the
restore goes on unplaced.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

_HEAD = 8  # magic (u32), seq id (i32)
_U32 = struct.Struct("<I")
_LAYER = struct.Struct("<iQ")  # type, row size
# The cell extension (x, y, token) of models with 2-D positions or per-layer embeddings.
_EXT_SIZES = (0, 12)


class Part(NamedTuple):
    """One cache part of a state: its cells and, per K and V layer, (type, row size)."""

    cells: int
    ext: int
    layers: list[tuple[int, int]]


def _part(data: bytes | bytearray, offset: int, ext: int) -> tuple[Part, int] | None:
    """The part at `offset` and the offset after it, or None if it does not parse."""
    try:
        (n_stream,) = _U32.unpack_from(data, offset)
        (cells,) = _U32.unpack_from(data, offset + 4)
        offset += 8
        if n_stream != 1:
            return None
        if cells == 0:
            return Part(0, ext, []), offset
        # A sequence's own state: one id per cell, so every cell has the same size.
        (n_seq,) = _U32.unpack_from(data, offset + 4)
        if n_seq != 1:
            return None
        offset += cells * (8 + ext + 4)
        v_trans, n_layer = struct.unpack_from("<II", data, offset)
        offset += 8
        if v_trans:
            return None
        layers = []
        for _ in range(2 * n_layer):  # K of every layer, then V of every layer
            kind, row = _LAYER.unpack_from(data, offset)
            offset += _LAYER.size + row * cells
            layers.append((kind, row))
    except struct.error:
        return None
    return Part(cells, ext, layers), offset


def parts(data: bytes | bytearray) -> list[Part] | None:
    """The cache parts of a sequence state; None if its bytes are not what this module
    knows (each cell extension size is tried; exactly one must read to the end)."""
    for ext in _EXT_SIZES:
        found: list[Part] = []
        offset = _HEAD
        while offset < len(data):
            read = _part(data, offset, ext)
            if read is None:
                break
            part, offset = read
            found.append(part)
        if offset == len(data) and found:
            return found
    return None


def window_pad(state: bytes | bytearray, n_cells: int) -> tuple[Any, int] | None:
    """A window-layers-only state (restored with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    of `n_cells` cells, as a numpy uint8 array, and the number of window cells `state`
    holds; None unless `state` has a full-attention part and a window part.

    Every pad cell is at position 0, so none is ever outside its sequence's window:
    llama.cpp hands such cells to other tokens, and these must stay put. Their rows
    are zeros: finite, and masked out for every other sequence.
    """
    found = parts(state)
    if found is None or len(found) != 2 or found[1].cells == 0 or n_cells <= 0:
        return None
    window = found[1]
    cell = struct.pack("<iI", 0, 1) + bytes(window.ext) + struct.pack("<i", 0)
    rows = sum(_LAYER.size + row * n_cells for _, row in window.layers)
    # numpy's zeros come from calloc: untouched pages cost nothing until llama.cpp reads
    # them. Imported here: the daemon loads numpy beside the model, not at import.
    import numpy as np
    out = np.zeros(_HEAD + 8 + len(cell) * n_cells + 8 + rows, np.uint8).data.cast("B")
    out[:_HEAD] = state[:_HEAD]
    struct.pack_into("<II", out, _HEAD, 1, n_cells)
    offset = _HEAD + 8
    out[offset:offset + len(cell) * n_cells] = cell * n_cells
    offset += len(cell) * n_cells
    struct.pack_into("<II", out, offset, 0, len(window.layers) // 2)
    offset += 8
    for kind, row in window.layers:
        _LAYER.pack_into(out, offset, kind, row)
        offset += _LAYER.size + row * n_cells
    return out.obj, window.cells
