"""The llama.cpp wrapper and the decode thread.

Everything here drives llama.cpp through llama-cpp-python's low-level ctypes API:
`llama_decode` on batches and llama.cpp's C sampler chain. No logits reach Python,
so per-token Python work is a few C calls, independent of the vocabulary size.

The decode thread only evaluates prompts, decodes and samples. It hands each
token's bytes to the event loop through `Job.pieces` and wakes the loop at most
once per batch of pieces; it never logs, encodes JSON or touches a socket.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .config import ModelConfig
from .llama_c import C

if TYPE_CHECKING:
    import asyncio

    from .grammar import GrammarSampler

log = logging.getLogger(__name__)

EndReason = Literal["stop", "length", "cancelled", "error"]

# llama.cpp takes LLAMA_DEFAULT_SEED (0xFFFFFFFF) as "pick a random seed", so client
# seeds are folded into the 32-bit range below it.
_SEED_MODULUS = 0xFFFFFFFF
# Tokens the repeat penalty looks back over (llama.cpp's default).
_PENALTY_LAST_N = 64
# llama_decode's return value when the abort callback said stop.
_DECODE_ABORTED = 2
# Prompt tokens in one step from which the step can be aborted (about 0.25 s of work).
_ABORTABLE_PREFILL = 128


class ModelLoadError(Exception):
    """The model file could not be loaded; the message names the path."""


class LoadAborted(ModelLoadError):
    """The load was stopped on request (a stop signal during start-up)."""


class EngineClosed(Exception):
    """The model has been freed; nothing may use the vocabulary any more."""


class TokenIdError(ValueError):
    """A token id outside the vocabulary; the message names it and its index."""


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    seed: int | None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    path: str
    name: str
    architecture: str
    n_params: int
    n_ctx_train: int
    n_vocab: int
    size_bytes: int
    chat_template: str | None


class Job:
    """One generation, shared between the event loop and the decode thread.

    The loop writes only `stop_requested`; the thread writes everything else and
    announces new pieces through `wake`, which the loop answers with `drain`.
    """

    __slots__ = (
        "prompt", "sampling", "max_tokens", "cache_prompt", "stop_requested",
        "pieces", "wake_pending", "_wake", "_finished", "loop",
        "n_cached", "t_start", "t_prompt_done", "t_first", "end_reason", "error",
        "slot", "evict", "exclusive", "kept", "grammar",
    )

    def __init__(
        self,
        prompt: list[int],
        sampling: Sampling,
        max_tokens: int,
        cache_prompt: bool,
        *,
        loop: asyncio.AbstractEventLoop,
        on_pieces: Callable[[], None],
        on_finished: Callable[[], None],
        grammar: GrammarSampler | None = None,
    ) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.cache_prompt = cache_prompt
        self.stop_requested = False
        # (token bytes, perf_counter_ns at sampling); appended by the thread only.
        self.pieces: deque[tuple[bytes, int]] = deque()
        self.wake_pending = False
        self.loop = loop
        self._wake = on_pieces
        self._finished = on_finished
        self.n_cached = 0
        self.t_start = 0
        self.t_prompt_done = 0
        self.t_first = 0
        self.end_reason: EndReason = "error"
        self.error: BaseException | None = None
        # Owned by the job: the decode thread frees it when the job ends; one that never
        # reaches the decode thread frees itself when collected.
        self.grammar = grammar
        # Set by the scheduler before submit: the sequence (slot) to run on, the idle
        # slots whose cached tokens must be dropped first to make room, and whether
        # the job must have the batch to itself (reproducible results).
        self.slot = 0
        self.evict: tuple[int, ...] = ()
        self.exclusive = False
        # Written by the decode thread as the job ends: the tokens its slot now holds.
        self.kept: list[int] = []

    @property
    def reserved_cells(self) -> int:
        """KV cells this job can come to hold: its prompt plus every token it may add."""
        return len(self.prompt) + self.max_tokens


class _Seq:
    """One slot's sequence in the KV cache; touched by the decode thread only."""

    __slots__ = ("id", "cached", "prompt_rows", "job", "sampler", "next_prompt",
                 "chunk_end", "n_out", "limit", "generating", "last_token")

    def __init__(self, seq_id: int) -> None:
        self.id = seq_id
        # Tokens whose rows are in the KV cache for this sequence, position by position.
        self.cached: list[int] = []
        # How many leading rows came from prompt evaluation (not single-token decode).
        self.prompt_rows = 0
        self.job: Job | None = None
        self.sampler: Any = None
        self.next_prompt = 0  # the first prompt token not yet in the cache
        self.chunk_end = 0  # the end of the prompt chunk in the current step
        self.n_out = 0
        self.limit = 0
        self.generating = False  # past its prompt: adds one token a step
        self.last_token = 0  # sampled, not yet decoded


def shared_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the common prefix of `a` and `b` (at most `limit`), compared a block
    at a time: list slices compare in C, so long prompts cost microseconds."""
    end = min(len(a), len(b))
    if limit is not None:
        end = min(end, max(limit, 0))
    start, block = 0, 256
    while start < end:
        stop = min(start + block, end)
        if a[start:stop] != b[start:stop]:
            while a[start] == b[start]:
                start += 1
            return start
        start = stop
    return end


def _drain_each(jobs: list[Job]) -> None:
    for job in jobs:
        job._wake()


class Engine:
    """One model, one context, `slots` sequences, one decode thread.

    The decode thread does everything that touches the context: it loads the
    model, runs the warm-up decode and then serves jobs. Loading on it lets the
    caller go on with its own start-up (imports, the socket) while llama.cpp reads
    the model, and keeps every llama_decode on one thread: libgomp keeps a worker
    team per calling thread, and a second team (say, from a warm-up elsewhere)
    left decode at 50 tok/s instead of 65 on 2 CPUs.
    """

    def __init__(
        self,
        model_path: str,
        model_config: ModelConfig,
        n_threads: int,
        n_threads_batch: int,
        *,
        slots: int = 1,
        prefill_per_step: int = 512,
    ) -> None:
        if not os.path.isfile(model_path):
            raise ModelLoadError(f"model file not found: {model_path}")
        self.model_path = model_path
        self.config = model_config
        self.n_threads = n_threads
        self.n_threads_batch = n_threads_batch
        self.slots = slots
        self._prefill_per_step = prefill_per_step
        # Resolved once the model is loaded and warmed up, or fails with ModelLoadError.
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._model: Any = None
        self._ctx: Any = None
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Bumped by the decode thread on every token, prompt batch, abort-callback
        # tick and load-progress callback: the systemd watchdog reads it to tell a
        # stuck decode thread from a busy one. A plain int store, nothing more.
        self.progress = 0
        self._abort_load = False
        self._load_progress = C.llama_progress_callback(self._on_load_progress)
        # Tokenizing off the decode thread (on the loop, or in a worker thread for a
        # long prompt) reads the vocabulary: close() waits for those readers and
        # refuses new ones before it frees the model.
        self._vocab_users = 0
        self._vocab_closed = False
        self._vocab_idle = threading.Condition()
        # Fault injection for the watchdog's tests: "decode_hang" makes the decode
        # thread stop making progress when it starts the next generation.
        self._failpoint = os.environ.get("SFCORE_FAILPOINT", "")

    def start(self) -> concurrent.futures.Future[None]:
        """Start loading on the decode thread; the returned future says when it is ready."""
        self._thread = threading.Thread(target=self._main, name="sfcore-decode", daemon=True)
        self._thread.start()
        return self.ready

    def _main(self) -> None:
        try:
            self._load()
            if self._abort_load:
                raise LoadAborted("the model load was stopped")
            self.warm_up()
        except BaseException as exc:
            self.ready.set_exception(exc)
            return
        self.ready.set_result(None)
        self._serve()

    def _load(self) -> None:
        model_path, model_config = self.model_path, self.config
        started = time.perf_counter()
        try:
            model = self._model = load_model(model_path, model_config, self._load_progress)
        except ModelLoadError:
            if self._abort_load:
                raise LoadAborted("the model load was stopped") from None
            raise
        ctx = C.llama_init_from_model(model, context_params(
            model_config, self.n_threads, self.n_threads_batch, self.slots))
        if not ctx:
            raise ModelLoadError(
                f"cannot create a context for {model_path} (n_ctx={model_config.n_ctx}); "
                "see the llama.cpp messages above"
            )
        self._ctx = ctx
        self.load_seconds = time.perf_counter() - started
        self._vocab = C.llama_model_get_vocab(model)
        self._memory = C.llama_get_memory(ctx)
        self.n_ctx = C.llama_n_ctx(ctx)
        self.n_ubatch = C.llama_n_ubatch(ctx)
        batch = C.llama_n_batch(ctx)
        # Reproducible mode cuts prompts at multiples of n_ubatch, so that a chunk
        # evaluated after a cache hit is cut exactly as in a cold run.
        self._prefill_chunk = (
            batch - batch % self.n_ubatch if model_config.reproducible else batch
        )
        self.info = _read_model_info(model, self._vocab, model_path)
        self.system_info = C.llama_print_system_info().decode(errors="replace")
        self.bos_text = self._special_text(C.llama_vocab_bos(self._vocab))
        self.eos_text = self._special_text(C.llama_vocab_eos(self._vocab))
        self._bos = C.llama_vocab_bos(self._vocab)
        self._add_bos = bool(C.llama_vocab_get_add_bos(self._vocab))

        self._n_batch = batch
        self._seqs = [_Seq(seq_id) for seq_id in range(self.slots)]
        self._active: list[_Seq] = []  # sequences with a job, in the order they began
        # One batch for every step, sized for n_batch tokens of one sequence each.
        self._batch = C.llama_batch_init(batch, 0, 1)
        for row in range(batch):
            self._batch.n_seq_id[row] = 1
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self._one_token = (C.llama_token * 1)()
        self._one_batch = C.llama_batch_get_one(self._one_token, 1)
        # The jobs of the prompt batch being decoded, for the abort callback.
        self._abort_jobs: list[Job] = []
        self._abort_callback = C.ggml_abort_callback(self._should_abort)
        self._no_abort_callback = C.ggml_abort_callback()

    # --- used from the event loop -----------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        """Thread-safe: llama.cpp's tokenizer only reads the vocabulary.

        `parse_special`: text that spells a special token (`<start_of_turn>`)
        becomes that token. Prompts of `generate` are parsed, as in llama-server;
        the content of chat messages is not.
        """
        with self._using_vocab():
            return self._tokenize(text, add_special, parse_special)

    def tokenize_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """Tokens of a rendered chat prompt: markup with special tokens parsed, content
        (is_content true) as plain text; BOS first when the model wants one."""
        tokens: list[int] = []
        with self._using_vocab():
            for text, is_content in segments:
                tokens.extend(self._tokenize(text, False, not is_content))
        if self._add_bos and (not tokens or tokens[0] != self._bos):
            tokens.insert(0, self._bos)
        return tokens

    def detokenize(self, tokens: list[int]) -> str:
        """Text of `tokens`; TokenIdError for an id outside the vocabulary.

        The inverse of `tokenize` with its defaults: a leading BOS the tokenizer
        added is dropped, and other special tokens are written out as their text.
        """
        n_vocab = self.info.n_vocab
        for index, token in enumerate(tokens):
            if not 0 <= token < n_vocab:
                raise TokenIdError(
                    f"token id {token} is outside the vocabulary (0..{n_vocab - 1})"
                    f" - at `$.tokens[{index}]`")
        array = (C.llama_token * max(len(tokens), 1))(*tokens)
        with self._using_vocab():
            capacity = 16 * len(tokens) + 16
            for _ in range(2):
                buf = ctypes.create_string_buffer(capacity)
                n = C.llama_detokenize(self._vocab, array, len(tokens), buf, capacity,
                                       True, True)
                if n >= 0:
                    return buf.raw[:n].decode("utf-8", errors="replace")
                capacity = -n
        raise RuntimeError("llama_detokenize kept asking for a larger buffer")

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (C.llama_token * capacity)()
        vocab = self._vocab
        n = C.llama_tokenize(vocab, data, len(data), tokens, capacity, add_special, parse_special)
        if n < 0:  # cannot happen with one slot per byte, but never trust a size guess
            capacity = -n
            tokens = (C.llama_token * capacity)()
            n = C.llama_tokenize(vocab, data, len(data), tokens, capacity, add_special,
                                 parse_special)
        return tokens[:n]

    @contextlib.contextmanager
    def _using_vocab(self) -> Iterator[None]:
        with self._vocab_idle:
            if self._vocab_closed:
                raise EngineClosed("the model has been unloaded")
            self._vocab_users += 1
        try:
            yield
        finally:
            with self._vocab_idle:
                self._vocab_users -= 1
                if self._vocab_users == 0:
                    self._vocab_idle.notify_all()

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        text = C.llama_vocab_get_text(self._vocab, token)
        return text.decode("utf-8", errors="replace") if text else ""

    def abort_load(self) -> None:
        """Make a model load in progress fail soon (at llama.cpp's next progress call)."""
        self._abort_load = True

    def _on_load_progress(self, _progress: float, _data: Any) -> bool:
        self.progress += 1
        return not self._abort_load

    def submit(self, job: Job) -> None:
        self._inbox.put(job)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the decode thread and free the model; False if something would not stop
        (then nothing is freed, and the OS reclaims it at exit).

        Called while the model is still loading, this aborts the load.
        """
        self._abort_load = True
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        with self._vocab_idle:
            self._vocab_closed = True
            if not self._vocab_idle.wait_for(lambda: self._vocab_users == 0, timeout):
                return False
        if self._ctx:
            C.llama_batch_free(self._batch)
            C.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            C.llama_model_free(self._model)
            self._model = None
            C.llama_backend_free()
        return True

    def warm_up(self) -> None:
        """One decode before serving, so the first request does not pay for first-touch costs."""
        bos = C.llama_vocab_bos(self._vocab)
        self._one_token[0] = bos if bos >= 0 else 0
        C.llama_decode(self._ctx, self._one_batch)
        C.llama_memory_clear(self._memory, False)

    # --- the decode thread ------------------------------------------------------------

    def _serve(self) -> None:
        """The step loop: each step is one llama_decode for every active sequence."""
        inbox, active = self._inbox, self._active
        while True:
            if not active:
                job = inbox.get()  # idle: sleep until work comes
                if job is None:
                    return
                self._begin(job)
            # Whatever arrived meanwhile joins this very step.
            while True:
                try:
                    job = inbox.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    for seq in list(active):
                        self._end(seq, "cancelled")
                    return
                self._begin(job)
            if not active:
                continue
            try:
                self._step()
            except BaseException as exc:  # the slots must survive anything; the loop logs it
                for seq in list(active):
                    assert seq.job is not None
                    seq.job.error = exc
                    self._end(seq, "error")

    def _begin(self, job: Job) -> None:
        """Put a new job on its slot: drop what the scheduler evicted, reuse the slot's
        cached prefix, build its sampler. Any failure ends the job, never the thread."""
        if self._failpoint == "decode_hang":
            while True:  # a stuck decode thread, for the watchdog's tests
                time.sleep(3600)
        job.t_start = time.perf_counter_ns()
        seq = self._seqs[job.slot]
        try:
            for slot in job.evict:
                self._forget(self._seqs[slot])
            n_reused = self._reuse_prefix(seq, job.prompt) if job.cache_prompt else 0
            if n_reused == 0:
                self._forget(seq)
            job.n_cached = n_reused
            seq.next_prompt = n_reused
            seq.n_out = 0
            seq.generating = False
            seq.limit = min(job.max_tokens, self.n_ctx - len(job.prompt))
            seq.sampler = self._make_sampler(job.sampling, job.prompt)
        except BaseException as exc:
            job.error = exc
            job.end_reason = "error"
            self._forget(seq)
            if job.grammar is not None:
                job.grammar.free()
            job.loop.call_soon_threadsafe(job._finished)
            return
        seq.job = job
        self._active.append(seq)

    def _step(self) -> None:
        active = self._active
        for seq in list(active):
            assert seq.job is not None
            if seq.job.stop_requested:
                self._end(seq, "cancelled")
        if not active:
            return
        batch = self._batch
        tokens, positions, seq_ids, wants = batch.token, batch.pos, batch.seq_id, batch.logits
        outputs: list[tuple[_Seq, int]] = []
        prefilling: list[_Seq] = []
        n = 0
        # Every generating sequence first: one token each, each asking for its logits.
        for seq in active:
            if seq.generating:
                tokens[n] = seq.last_token
                positions[n] = len(seq.cached)
                seq_ids[n][0] = seq.id
                wants[n] = 1
                outputs.append((seq, n))
                n += 1
        # Then prompt tokens, oldest request first. Alone, a prompt goes in whole
        # n_batch chunks; beside streaming sequences, at most prefill_per_step tokens
        # a step, so their next token is never held up by a whole long prompt.
        budget = self._n_batch - n if n == 0 else min(self._prefill_per_step, self._n_batch - n)
        chunk = self._prefill_chunk
        for seq in active:
            if budget <= 0:
                break
            if seq.generating:
                continue
            job = seq.job
            assert job is not None
            prompt, pos, sid = job.prompt, seq.next_prompt, seq.id
            end = min(pos - pos % chunk + chunk, len(prompt), pos + budget)
            for index in range(pos, end):
                tokens[n] = prompt[index]
                positions[n] = index
                seq_ids[n][0] = sid
                wants[n] = 0
                n += 1
            budget -= end - pos
            seq.chunk_end = end
            prefilling.append(seq)
            if end == len(prompt):
                wants[n - 1] = 1
                outputs.append((seq, n - 1))
        batch.n_tokens = n

        ctx = self._ctx
        if n - len(outputs) >= _ABORTABLE_PREFILL:
            # A big prompt batch can take seconds: the abort callback stops it once
            # every sequence in it is cancelled. Installed for those batches only:
            # llama.cpp polls it once per graph node (a Python call holding the GIL),
            # hundreds of times a step, and a small batch ends soon anyway.
            self._abort_jobs = [seq.job for seq in active if seq.job is not None]
            C.llama_set_abort_callback(ctx, self._abort_callback, None)
            try:
                rc = C.llama_decode(ctx, batch)
            finally:
                C.llama_set_abort_callback(ctx, self._no_abort_callback, None)
                self._abort_jobs = []
        else:
            rc = C.llama_decode(ctx, batch)
        self.progress += 1
        if rc == _DECODE_ABORTED:
            # Whole ubatches done before the abort stay in the cache; drop them so
            # each sequence's cache holds exactly its `cached` tokens.
            for seq in list(active):
                C.llama_memory_seq_rm(self._memory, seq.id, len(seq.cached), -1)
                self._end(seq, "cancelled")
            return
        if rc != 0:
            raise RuntimeError(f"llama_decode failed (code {rc}, {n} tokens)")

        for seq in active:
            if seq.generating:
                seq.cached.append(seq.last_token)
        now = time.perf_counter_ns()
        for seq in prefilling:
            job = seq.job
            assert job is not None
            seq.cached.extend(job.prompt[seq.next_prompt:seq.chunk_end])
            seq.next_prompt = seq.prompt_rows = seq.chunk_end
            if seq.chunk_end == len(job.prompt):
                job.t_prompt_done = now

        sample, is_eog, vocab = C.llama_sampler_sample, C.llama_vocab_is_eog, self._vocab
        pieces, clock = self._pieces, time.perf_counter_ns
        woken: list[Job] = []
        for seq, row in outputs:
            job = seq.job
            assert job is not None
            grammar = job.grammar
            if grammar is None:
                token = sample(seq.sampler, ctx, row)
            else:  # checks the chain's choice against the grammar (see grammar.py)
                token = grammar.sample(seq.sampler, ctx, row)
            now = clock()
            if seq.n_out == 0:
                job.t_first = now
            if is_eog(vocab, token):
                self._end(seq, "stop")
                continue
            piece = pieces.get(token)
            if piece is None:
                piece = self._piece(token)
            job.pieces.append((piece, now))
            if not job.wake_pending:
                job.wake_pending = True
                woken.append(job)
            seq.n_out += 1
            if seq.n_out >= seq.limit:
                self._end(seq, "length")
                continue
            seq.last_token = token
            seq.generating = True
        if woken:
            # One wake-up of the event loop per step, whatever the number of streams.
            woken[0].loop.call_soon_threadsafe(_drain_each, woken)

    def _end(self, seq: _Seq, reason: EndReason) -> None:
        job = seq.job
        assert job is not None
        job.end_reason = reason
        if reason == "error":
            self._forget(seq)
        if seq.sampler is not None:
            C.llama_sampler_free(seq.sampler)
            seq.sampler = None
        if job.grammar is not None:
            job.grammar.free()
        job.kept = list(seq.cached)
        seq.job = None
        self._active.remove(seq)
        job.loop.call_soon_threadsafe(job._finished)

    def _should_abort(self, _data: Any) -> bool:
        self.progress += 1
        jobs = self._abort_jobs
        return bool(jobs) and all(job.stop_requested for job in jobs)

    def _reuse_prefix(self, seq: _Seq, prompt: list[int]) -> int:
        """Give `seq` the longest usable cached prefix of `prompt`, from its own cache or,
        when another slot holds a longer one (a common system prompt), by sharing that
        slot's cells (llama_memory_seq_cp: a reference, not a copy). Returns its length."""
        memory = self._memory
        best, best_n = seq, self._usable(seq, prompt)
        for other in self._seqs:
            if other is not seq:
                n = self._usable(other, prompt)
                if n > best_n:
                    best, best_n = other, n
        if best_n == 0:
            return 0
        if best is not seq:
            self._forget(seq)
            C.llama_memory_seq_cp(memory, best.id, seq.id, 0, best_n)
            seq.cached.extend(best.cached[:best_n])
            seq.prompt_rows = min(best.prompt_rows, best_n)
            return best_n
        removed = C.llama_memory_seq_rm(memory, seq.id, best_n, -1)
        if not removed or C.llama_memory_seq_pos_min(memory, seq.id) > 0:
            return 0
        del seq.cached[best_n:]
        seq.prompt_rows = min(seq.prompt_rows, best_n)
        return best_n

    def _usable(self, seq: _Seq, prompt: list[int]) -> int:
        """How much of `seq`'s cache `prompt` could reuse."""
        # The last prompt token must be evaluated, to produce logits.
        n = shared_prefix(seq.cached, prompt, len(prompt) - 1)
        if self.config.reproducible:
            # Only whole n_ubatch-aligned chunks of earlier prompt evaluation are
            # bit-identical to what a cold run computes.
            n = min(n, seq.prompt_rows)
            n -= n % self.n_ubatch
        return n

    def _forget(self, seq: _Seq) -> None:
        C.llama_memory_seq_rm(self._memory, seq.id, -1, -1)
        seq.cached.clear()
        seq.prompt_rows = 0

    def _make_sampler(self, sampling: Sampling, prompt: list[int]) -> Any:
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        add = C.llama_sampler_chain_add
        # Cheap filters first: top_k shrinks the candidates before anything sorts them.
        if sampling.temperature > 0 and sampling.top_k > 0:
            add(chain, C.llama_sampler_init_top_k(sampling.top_k))
        if sampling.repeat_penalty != 1.0:
            n_vocab = C.llama_vocab_n_tokens(self._vocab)
            penalties = C.llama_sampler_init_penalties(
                n_vocab, _PENALTY_LAST_N, sampling.repeat_penalty, 0.0, 0.0)
            add(chain, penalties)
            # The prompt's tail counts as "recent" too, as in llama.cpp's own tools.
            for token in prompt[-_PENALTY_LAST_N:]:
                C.llama_sampler_accept(chain, token)
        if sampling.temperature <= 0:
            if sampling.repeat_penalty == 1.0:
                # The same argmax, faster: llama.cpp's greedy loop over 262k candidates
                # took 299 us per token here, top_k(1) then greedy 209 us.
                add(chain, C.llama_sampler_init_top_k(1))
            add(chain, C.llama_sampler_init_greedy())
            return chain
        if sampling.top_p < 1.0:
            add(chain, C.llama_sampler_init_top_p(sampling.top_p, 1))
        if sampling.min_p > 0.0:
            add(chain, C.llama_sampler_init_min_p(sampling.min_p, 1))
        add(chain, C.llama_sampler_init_temp(sampling.temperature))
        seed = C.LLAMA_DEFAULT_SEED if sampling.seed is None else sampling.seed % _SEED_MODULUS
        add(chain, C.llama_sampler_init_dist(seed))
        return chain

    def _piece(self, token: int) -> bytes:
        buf = self._piece_buf
        n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        piece = buf.raw[:n]
        self._pieces[token] = piece
        return piece


def load_model(model_path: str, model_config: ModelConfig, progress: Any = None) -> Any:
    """llama_backend_init, then the model with the daemon's settings; ModelLoadError
    (with llama.cpp's own reason, in one line) if it cannot be loaded.

    `progress`: a llama_progress_callback; when it returns False the load stops
    (and fails like any other load; the caller knows why).
    """
    C.llama_backend_init()
    params = C.llama_model_default_params()
    params.n_gpu_layers = model_config.n_gpu_layers
    params.load_mode = load_mode(model_config.use_mmap, model_config.use_mlock)
    if progress is not None:
        params.progress_callback = progress
    with _router.capturing_errors() as errors:
        model = C.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        C.llama_backend_free()
        reason = errors[0] if errors else "not a GGUF model this llama.cpp can load"
        raise ModelLoadError(f"cannot load model {model_path}: {reason}")
    return model


def context_params(model_config: ModelConfig, n_threads: int, n_threads_batch: int,
                   slots: int = 1) -> Any:
    """The daemon's llama_context_params; the tuner and the benchmark use the same."""
    params = C.llama_context_default_params()
    params.n_ctx = model_config.n_ctx
    params.n_batch = model_config.n_batch
    params.n_ubatch = model_config.n_ubatch
    params.n_seq_max = slots
    # One KV pool shared by every slot: a request may use as much of n_ctx as the
    # others leave, and no slot's share sits idle (see README, "Parallel slots").
    params.kv_unified = True
    # Only logits of a prompt's last token and of each generating sequence are ever
    # read, at most one row per slot a step. Without this llama.cpp reserves logits
    # for n_ubatch outputs: 512 x 262k floats, a 514 MiB buffer.
    params.n_outputs_max = slots
    params.n_threads = n_threads
    params.n_threads_batch = n_threads_batch
    params.flash_attn_type = _flash_attn_type(model_config.flash_attn)
    # A full-size sliding-window cache: with llama.cpp's default small one, rows
    # before the window are pruned and a reused prefix silently changes the output.
    params.swa_full = True
    params.no_perf = True
    return params


def load_mode(use_mmap: bool, use_mlock: bool) -> int:
    if use_mmap:
        return C.LLAMA_LOAD_MODE_MMAP_MLOCK if use_mlock else C.LLAMA_LOAD_MODE_MMAP
    return C.LLAMA_LOAD_MODE_MLOCK if use_mlock else C.LLAMA_LOAD_MODE_NONE


def _flash_attn_type(setting: bool | str) -> int:
    if setting == "auto":
        return C.LLAMA_FLASH_ATTN_TYPE_AUTO
    return C.LLAMA_FLASH_ATTN_TYPE_ENABLED if setting else C.LLAMA_FLASH_ATTN_TYPE_DISABLED


def _meta(model: Any, key: str) -> str | None:
    buf = ctypes.create_string_buffer(1024)
    n = C.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        C.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace")


def _read_model_info(model: Any, vocab: Any, path: str) -> ModelInfo:
    template = C.llama_model_chat_template(model, None)
    return ModelInfo(
        path=path,
        name=_meta(model, "general.name") or os.path.basename(path),
        architecture=_meta(model, "general.architecture") or "unknown",
        n_params=C.llama_model_n_params(model),
        n_ctx_train=C.llama_model_n_ctx_train(model),
        n_vocab=C.llama_vocab_n_tokens(vocab),
        size_bytes=os.path.getsize(path),
        chat_template=template.decode("utf-8", errors="replace") if template else None,
    )


def llama_cpp_version() -> str:
    """The vendored llama.cpp's commit and ggml version, e.g. "0c1e570 (ggml 0.25.3)"."""
    parts = []
    for name in ("ggml_commit", "ggml_version"):
        try:
            function = getattr(C._lib, name)
        except AttributeError:  # an older build without these
            parts.append("unknown")
            continue
        function.restype = ctypes.c_char_p
        function.argtypes = []
        value = function()
        parts.append(value.decode(errors="replace") if value else "unknown")
    commit, ggml = parts
    return f"{commit.removesuffix('-dirty')} (ggml {ggml})"


# --- llama.cpp's own log lines ------------------------------------------------------------

# enum ggml_log_level of the bundled ggml: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4,
# CONT=5 (llama-cpp-python's _logger.py still documents an older numbering).
_GGML_LEVELS = {
    1: logging.DEBUG,
    2: logging.DEBUG,  # INFO: the model loader prints ~150 lines at this level
    3: logging.WARNING,
    4: logging.ERROR,
}
_llama_log = logging.getLogger("sfcore_daemon.llama_cpp")


class _LlamaLogRouter:
    """Collect llama.cpp's log fragments into lines and hand them to logging.

    logging here ends in a QueueHandler, so even a rare message emitted from the
    decode thread costs only a record and a queue put there.
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._level = logging.DEBUG
        self._captured: list[str] | None = None
        self.callback = C.llama_log_callback(self._on_log)

    @contextlib.contextmanager
    def capturing_errors(self) -> Iterator[list[str]]:
        """Collect llama.cpp's error lines (logged at DEBUG meanwhile) for one message
        of our own: a user sees the reason once, not four lines of loader internals."""
        captured: list[str] = []
        self._captured = captured
        try:
            yield captured
        finally:
            self._captured = None

    def _on_log(self, level: int, text: bytes, _user_data: Any) -> None:
        if level != 5:  # GGML_LOG_LEVEL_CONT continues the previous line's level
            self._level = _GGML_LEVELS.get(level, logging.DEBUG)
        level = self._level
        capture = self._captured is not None and level >= logging.ERROR
        if capture:
            level = logging.DEBUG
        elif not _llama_log.isEnabledFor(level):
            return
        chunk = text.decode("utf-8", errors="replace")
        self._parts.append(chunk)
        if chunk.endswith("\n"):
            line = "".join(self._parts).rstrip()
            self._parts.clear()
            if not line:
                return
            if capture and self._captured is not None:
                # "func: message" -> "message"
                self._captured.append(line.split(": ", 1)[-1])
            _llama_log.log(level, "%s", line)


_router = _LlamaLogRouter()


def route_llama_logs() -> None:
    C.llama_log_set(_router.callback, ctypes.c_void_p(0))
