"""The model the tuner measures, loaded once, and its contexts: decode, prefill and step
costs as the daemon runs them (greedy single tokens; a prompt in n_batch chunks; one
sequence's logit rows)."""

from __future__ import annotations

import ctypes
import logging
import math
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec

from sfcore_daemon.config import Config
from sfcore_daemon.tune.configfile import TuneError
from sfcore_daemon.tune.rows import row_sizes

# Decode is measured after a short prompt, as in a typical chat turn's first tokens.
DECODE_PROMPT_TOKENS = 16
# Real text, so the prompt tokens look like what the daemon evaluates.
PROMPT_TEXT = (
    "The quick brown fox jumps over the lazy dog. Local language models answer "
    "questions, summarise documents and write code on ordinary hardware. "
    "Memory bandwidth bounds token generation, while prompt evaluation is bound "
    "by arithmetic, so the best thread counts for the two often differ. "
)


def _silence_llama_logs() -> None:
    """llama.cpp's lines go nowhere; a load failure still reaches the user through
    ModelLoadError, which carries llama.cpp's own reason."""
    from sfcore_daemon.llama.logrouter import route_llama_logs

    route_llama_logs()
    llama_log = logging.getLogger("sfcore_daemon.llama_cpp")
    llama_log.setLevel(logging.CRITICAL + 1)
    llama_log.propagate = False


class Bench:
    """One loaded model; contexts are created per n_ubatch on demand.

    Every llama_decode runs on the thread that created the Bench: libgomp keeps a
    worker team per calling thread, and a second thread decodes slower
    (docs/performance/tune.md).
    """

    def __init__(self, model_path: str, config: Config, pinned: Sequence[int]) -> None:
        from sfcore_daemon.llama.capi import C
        from sfcore_daemon.llama.model import ModelLoadError, load_model
        from sfcore_daemon.system.hugepages import HugePageLoad

        self.C = C
        self.config = config
        self.pinned = pinned
        _silence_llama_logs()
        try:
            # The weights in the pages the daemon gives them, so that they cost the same.
            huge_pages = HugePageLoad() if config.model.huge_pages else None
            self.model, _ = load_model(model_path, config.model, huge_pages=huge_pages)
        except ModelLoadError as exc:
            raise TuneError(str(exc)) from None
        self.vocab = C.llama_model_get_vocab(self.model)

    def close(self) -> None:
        self.C.llama_model_free(self.model)
        self.C.llama_backend_free()

    def prompt(self, n_tokens: int) -> Any:
        """`n_tokens` tokens of real text (BOS first), as a ctypes array."""
        C = self.C
        data = PROMPT_TEXT.encode()
        buffer = (C.llama_token * (len(data) + 8))()
        n = C.llama_tokenize(self.vocab, data, len(data), buffer, len(buffer), False, False)
        text = list(buffer[:max(n, 0)]) or [0]
        bos = C.llama_vocab_bos(self.vocab)
        tokens = ([bos] if bos >= 0 else []) + text * math.ceil(n_tokens / len(text))
        return (C.llama_token * n_tokens)(*tokens[:n_tokens])

    @contextmanager
    def context(self, n_ubatch: int) -> Iterator[Context]:
        from sfcore_daemon.llama.model import context_params

        model_config = msgspec.structs.replace(self.config.model, n_ubatch=n_ubatch)
        # Logits for every row of the largest step row_costs measures (llama.cpp
        # aborts on a step with more logit rows than the context reserved).
        params = context_params(model_config, 1, 1, draft_rows=max(row_sizes()))
        ctx = self.C.llama_init_from_model(self.model, params)
        if not ctx:
            raise TuneError(f"cannot create a context with n_ctx={model_config.n_ctx} "
                            f"n_ubatch={n_ubatch} (out of memory?)")
        try:
            yield Context(self.C, ctx)
        finally:
            self.C.llama_free(ctx)


class Context:
    """One llama_context, measured at different thread counts."""

    def __init__(self, C: Any, ctx: Any) -> None:
        self.C = C
        self.ctx = ctx
        self.memory = self.C.llama_get_memory(ctx)
        self.n_batch = self.C.llama_n_batch(ctx)
        self.n_ubatch = self.C.llama_n_ubatch(ctx)

    def warm_up(self, prompt: Any) -> None:
        """One full ubatch first: it touches the model's pages and the largest compute graph."""
        self._clear()
        self._evaluate(prompt, min(len(prompt), self.n_ubatch))

    def prefill_rate(self, prompt: Any, n_tokens: int, n_threads_batch: int) -> float:
        C = self.C
        C.llama_set_n_threads(self.ctx, 1, n_threads_batch)
        self._clear()
        started = time.perf_counter_ns()
        self._evaluate(prompt, n_tokens)
        C.llama_synchronize(self.ctx)
        return n_tokens * 1e9 / (time.perf_counter_ns() - started)

    def decode_rate(self, prompt: Any, n_threads: int, n_tokens: int) -> float:
        C, ctx = self.C, self.ctx
        C.llama_set_n_threads(ctx, n_threads, n_threads)
        self._clear()
        self._evaluate(prompt, DECODE_PROMPT_TOKENS)
        sampler = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        C.llama_sampler_chain_add(sampler, C.llama_sampler_init_greedy())
        one_token = (C.llama_token * 1)()
        one_batch = C.llama_batch_get_one(one_token, 1)
        sample, decode = C.llama_sampler_sample, C.llama_decode
        try:
            started = time.perf_counter_ns()
            # End-of-generation tokens are decoded like any other: every run does the same work.
            for _ in range(n_tokens):
                one_token[0] = sample(sampler, ctx, -1)
                if decode(ctx, one_batch) != 0:
                    raise TuneError("llama_decode failed while decoding")
            elapsed = time.perf_counter_ns() - started
        finally:
            C.llama_sampler_free(sampler)
        return n_tokens * 1e9 / elapsed

    def row_costs(self, prompt: Any, n_threads: int, sizes: Sequence[int],
                  rounds: int) -> dict[int, float]:
        """Median ms of one llama_decode of each size in `sizes` (rows of one sequence
        after a short prompt, every row asking for logits, as a step verifying a draft),
        over `rounds` rounds in a shuffled order each."""
        C, ctx = self.C, self.ctx
        C.llama_set_n_threads(ctx, n_threads, n_threads)
        self._clear()
        self._evaluate(prompt, DECODE_PROMPT_TOKENS)
        most = max(sizes)
        batch = C.llama_batch_init(most, 0, 1)
        order = random.Random(0)
        samples: dict[int, list[float]] = {size: [] for size in sizes}
        try:
            for row in range(most):
                batch.token[row] = prompt[row % len(prompt)]
                batch.pos[row] = DECODE_PROMPT_TOKENS + row
                batch.n_seq_id[row] = 1
                batch.seq_id[row][0] = 0
                batch.logits[row] = 1
            for _ in range(rounds):
                shuffled = list(sizes)
                order.shuffle(shuffled)
                for size in shuffled:
                    batch.n_tokens = size
                    started = time.perf_counter_ns()
                    if C.llama_decode(ctx, batch) != 0:
                        raise TuneError(f"llama_decode failed on a {size}-row step")
                    C.llama_synchronize(ctx)
                    samples[size].append((time.perf_counter_ns() - started) / 1e6)
                    C.llama_memory_seq_rm(self.memory, 0, DECODE_PROMPT_TOKENS, -1)
        finally:
            C.llama_batch_free(batch)
        return {size: statistics.median(times) for size, times in samples.items()}

    def _clear(self) -> None:
        # Outside the timed part: with data=True it zeroes the whole KV cache
        # (150 MB at n_ctx 8192 for the default model).
        self.C.llama_memory_clear(self.memory, True)

    def _evaluate(self, prompt: Any, n_tokens: int) -> None:
        """Evaluate prompt[:n_tokens] in n_batch chunks, as the daemon does."""
        C = self.C
        base, size = ctypes.addressof(prompt), ctypes.sizeof(C.llama_token)
        for pos in range(0, n_tokens, self.n_batch):
            chunk = min(self.n_batch, n_tokens - pos)
            start = ctypes.cast(base + pos * size, C.llama_token_p)
            if C.llama_decode(self.ctx, C.llama_batch_get_one(start, chunk)) != 0:
                raise TuneError(f"llama_decode failed on a {chunk}-token batch")
