"""The warm-up decode that doubles as a check of the llama.cpp build.

One batch of several tokens, decoded before the daemon says `ready` (llama-server
warms up the same way) and by `sfcore-daemon --self-check`. A batch of one token takes
other kernels than a batch of many: an AMX Xeon running a miscompiled build decoded
single tokens and died of SIGILL at the first prompt. With the batch here, a build that
cannot run on this CPU dies at start-up, where faulthandler (on from cli.main) writes
the signal and this function's frame to stderr, instead of at a user's request.

SFCORE_FAILPOINT=warmup_trap (tests only) makes the decode die of SIGILL the same way.
"""

from __future__ import annotations

import os
import signal
import time

from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.model import Model, ModelLoadError

# 32 rows: two full 16-row tiles of ggml's AMX kernels, and the same batched matmul path
# on every other CPU; a few ms on the default model.
WARM_UP_TOKENS = 32


def _trap_armed() -> bool:
    points = os.environ.get("SFCORE_FAILPOINT", "").split(",")
    return "warmup_trap" in (point.strip() for point in points)


def check_batched_decode(model: Model) -> float:
    """Decode one batch of WARM_UP_TOKENS tokens in sequence 0, then clear the cache;
    the milliseconds it took. ModelLoadError if llama_decode refuses the batch."""
    count = max(2, min(WARM_UP_TOKENS, model.n_batch))
    n_vocab = model.info.n_vocab
    bos = C.llama_vocab_bos(model.vocab)
    # Any valid ids do: the check is the kernels, not the text.
    tokens = [bos if bos >= 0 else 0, *(index % (n_vocab - 1) + 1 for index in range(count - 1))]
    batch = (C.llama_token * count)(*tokens)
    started = time.perf_counter()
    if _trap_armed():
        # A real fatal signal from the decoding thread, as a trapping kernel raises it.
        signal.raise_signal(signal.SIGILL)
    status = C.llama_decode(model.ctx, C.llama_batch_get_one(batch, count))
    elapsed_ms = (time.perf_counter() - started) * 1000
    C.llama_memory_clear(model.memory, False)
    if status != 0:
        raise ModelLoadError(f"the warm-up decode of a {count}-token batch failed "
                             f"(llama_decode returned {status}); see the llama.cpp messages "
                             "above")
    return elapsed_ms
