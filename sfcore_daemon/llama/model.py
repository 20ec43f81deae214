"""The llama.cpp model, its context and vocabulary, and their lifetime.

`Model.load` reads the GGUF file and creates the context (on the decode thread);
tokenizing and detokenizing may run on any thread, and `close` waits for those
readers before it frees the vocabulary with the model.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.llama import invariant
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.ctxsize import ContextSize, context_size
from sfcore_daemon.llama.gpu import gpu_layers, placement
from sfcore_daemon.llama.logrouter import llama_log_router
from sfcore_daemon.llama.repack import Repacked, weights_for
from sfcore_daemon.system.hugepages import HugePageLoad, HugePages


class ModelLoadError(Exception):
    """The model file could not be loaded; the message names the path."""


class LoadAborted(ModelLoadError):
    """The load was stopped on request (a stop signal during start-up)."""


class EngineClosed(Exception):
    """The model has been freed; nothing may use the vocabulary any more."""


class TokenIdError(ValueError):
    """A token id outside the vocabulary; the message names it and its index."""



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


class Model:
    """A loaded model and its context: the vocabulary, the tokenizer, token pieces."""

    def __init__(self, path: str, model: Any, ctx: Any, load_seconds: float, *,
                 n_gpu_layers: int = 0, huge_pages: HugePages | None = None) -> None:
        self.path = path
        self.model = model
        self.ctx = ctx
        self.load_seconds = load_seconds
        self.huge_pages = huge_pages or HugePages(note="off ([model] huge_pages = false)")
        self.vocab = C.llama_model_get_vocab(model)
        self.memory = C.llama_get_memory(ctx)
        self.n_ctx: int = C.llama_n_ctx(ctx)
        # How n_ctx was chosen and what its KV cache costs (ctxsize.py); set by load.
        self.context_size = ContextSize(self.n_ctx, 0, 0, 0)
        # The file llama.cpp read: `path`, or its copy with Q5_0 as Q8_0 (repack.py).
        self.weights = Repacked(path, False)
        self.n_ubatch: int = C.llama_n_ubatch(ctx)
        self.n_batch: int = C.llama_n_batch(ctx)
        self.info = _read_model_info(model, self.vocab, path)
        self.system_info: str = C.llama_print_system_info().decode(errors="replace")
        # Where the layers went, for the start-up log (gpu.Placement.line).
        self.placement = placement(model, n_gpu_layers).line()
        self.bos_text = self._special_text(C.llama_vocab_bos(self.vocab))
        self.eos_text = self._special_text(C.llama_vocab_eos(self.vocab))
        self._bos = C.llama_vocab_bos(self.vocab)
        self._add_bos = bool(C.llama_vocab_get_add_bos(self.vocab))
        self.pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        # Tokenizing off the decode thread reads the vocabulary: close() waits for those
        # readers and refuses new ones before it frees the model.
        self._vocab_users = 0
        self._vocab_closed = False
        self._vocab_idle = threading.Condition()

    @classmethod
    def load(cls, path: str, config: ModelConfig, n_threads: int, n_threads_batch: int, *,
             slots: int, draft_rows: int = 0, spare_seqs: int = 0,
             progress: Callable[[float], bool] | None = None,
             before_context: Callable[[Any, int], None] | None = None) -> Model:
        """The model with its context; ModelLoadError (with llama.cpp's reason) if either
        cannot be made. `progress`: see load_model. `before_context`: called with the
        loaded model and the context's size before the context is made."""
        started = time.perf_counter()
        huge_pages = HugePageLoad() if config.huge_pages else None
        model, weights = load_model(path, config, progress, huge_pages)
        size = context_size(model, functools.partial(model_meta, model), config.n_ctx,
                            config.kv_budget_mb)
        if before_context is not None:
            before_context(model, size.n_ctx)
        ctx = C.llama_init_from_model(model, context_params(
            config, n_threads, n_threads_batch, slots, draft_rows, spare_seqs=spare_seqs,
            n_ctx=size.n_ctx))
        if not ctx:
            C.llama_model_free(model)
            C.llama_backend_free()
            raise ModelLoadError(
                f"cannot create a context for {path} (n_ctx={size.n_ctx}); "
                "see the llama.cpp messages above"
            )
        loaded = cls(path, model, ctx, time.perf_counter() - started,
                     n_gpu_layers=gpu_layers(config.n_gpu_layers),
                     huge_pages=huge_pages.finish() if huge_pages is not None else None)
        loaded.context_size = size._replace(n_ctx=loaded.n_ctx)
        loaded.weights = weights
        return loaded

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        """Thread-safe: llama.cpp's tokenizer only reads the vocabulary.

        `parse_special`: text that spells a special token (`<start_of_turn>`)
        becomes that token. Prompts of `generate` are parsed, as in llama-server;
        the content of chat messages is not.
        """
        with self.using_vocab():
            return self._tokenize(text, add_special, parse_special)

    def tokenize_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """Tokens of a rendered chat prompt: markup with special tokens parsed, content
        (is_content true) as plain text; BOS first when the model wants one."""
        tokens: list[int] = []
        with self.using_vocab():
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
        with self.using_vocab():
            capacity = 16 * len(tokens) + 16
            for _ in range(2):
                buf = ctypes.create_string_buffer(capacity)
                n = C.llama_detokenize(self.vocab, array, len(tokens), buf, capacity,
                                       True, True)
                if n >= 0:
                    return buf.raw[:n].decode("utf-8", errors="replace")
                capacity = -n
        raise RuntimeError("llama_detokenize kept asking for a larger buffer")

    def tokenize_bytes(self, data: bytes) -> list[int]:
        """Tokens for raw bytes (a text cut inside a character need not be UTF-8), no
        BOS, special text not parsed. Any thread."""
        with self.using_vocab():
            return self._tokenize_bytes(data, False, False)

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self._tokenize_bytes(text.encode("utf-8"), add_special, parse_special)

    def _tokenize_bytes(self, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
        capacity = len(data) + 8
        tokens = (C.llama_token * capacity)()
        vocab = self.vocab
        n = C.llama_tokenize(vocab, data, len(data), tokens, capacity, add_special, parse_special)
        if n < 0:  # cannot happen with one slot per byte, but never trust a size guess
            capacity = -n
            tokens = (C.llama_token * capacity)()
            n = C.llama_tokenize(vocab, data, len(data), tokens, capacity, add_special,
                                 parse_special)
        return tokens[:n]

    @contextlib.contextmanager
    def using_vocab(self) -> Iterator[None]:
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
        text = C.llama_vocab_get_text(self.vocab, token)
        return text.decode("utf-8", errors="replace") if text else ""

    def piece(self, token: int) -> bytes:
        """The bytes of `token`, remembered in `pieces` (decode thread only)."""
        piece = self.piece_into(token, self._piece_buf)
        self.pieces[token] = piece
        return piece

    def piece_into(self, token: int, buf: Any) -> bytes:
        """The bytes of `token`, read through `buf` (a ctypes string buffer; any thread
        with a buffer of its own), not remembered."""
        n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        raw: bytes = buf.raw[:n]
        return raw

    def close(self, timeout: float) -> bool:
        """Free the context and the model once no thread reads the vocabulary; False
        (nothing freed) if a reader is still busy after `timeout` seconds."""
        with self._vocab_idle:
            self._vocab_closed = True
            if not self._vocab_idle.wait_for(lambda: self._vocab_users == 0, timeout):
                return False
        if self.ctx:
            C.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            C.llama_model_free(self.model)
            self.model = None
            C.llama_backend_free()
        return True


def load_model(model_path: str, model_config: ModelConfig,
               progress: Callable[[float], bool] | None = None,
               huge_pages: HugePageLoad | None = None) -> tuple[Any, Repacked]:
    """llama_backend_init, then the model with the daemon's settings, and the file it was
    read from (the source or its copy with Q5_0 as Q8_0, repack.py); ModelLoadError (with
    llama.cpp's own reason, in one line, naming `model_path`) if it cannot be loaded.

    `progress`: called with the fraction loaded before each tensor; when it returns
    False the load stops (and fails like any other load; the caller knows why).
    `huge_pages`: marks the weights' buffers at the first call, before they are written.
    """
    # Read by llama.cpp's CPU backend as it starts (invariant.py); the daemon has set it
    # already, the tuner and the benches' workers set it here.
    invariant.enable(model_config.reproducible)
    C.llama_backend_init()
    params = C.llama_model_default_params()
    params.n_gpu_layers = gpu_layers(model_config.n_gpu_layers)
    params.load_mode = load_mode(model_config.use_mmap, model_config.use_mlock)
    first_call = True

    def on_progress(fraction: float, _data: Any) -> bool:
        nonlocal first_call
        if first_call and huge_pages is not None:
            # The buffers exist now and no weight is written yet.
            huge_pages.mark_new()
        first_call = False
        return progress(fraction) if progress is not None else True

    # Kept in a local for as long as llama.cpp may call it.
    callback = C.llama_progress_callback(on_progress)
    if progress is not None or huge_pages is not None:
        params.progress_callback = callback
    weights = weights_for(model_path, model_config)
    with llama_log_router.capturing_errors() as errors:
        model = C.llama_model_load_from_file(weights.path.encode(), params)
    if not model:
        C.llama_backend_free()
        reason = errors[0] if errors else "not a GGUF model this llama.cpp can load"
        raise ModelLoadError(f"cannot load model {model_path}: {reason}")
    return model, weights


def context_params(model_config: ModelConfig, n_threads: int, n_threads_batch: int,
                   slots: int = 1, draft_rows: int = 0, *, spare_seqs: int = 0,
                   n_ctx: int | None = None) -> Any:
    """The daemon's llama_context_params; the tuner and the benchmark use the same.
    `spare_seqs`: sequence ids beyond the slots' that are never decoded (kvcache.py).
    `n_ctx`: the context chosen for the model (ctxsize.py), else the config's."""
    params = C.llama_context_default_params()
    params.n_ctx = n_ctx if n_ctx is not None else model_config.n_ctx
    params.n_batch = model_config.n_batch
    params.n_ubatch = model_config.n_ubatch
    params.n_seq_max = slots + spare_seqs
    # One KV pool shared by every slot: a request may use as much of n_ctx as the others
    # leave, and no slot's share sits idle (docs/performance/slots.md).
    params.kv_unified = True
    # Only a row per slot plus the step's draft rows are ever read, else llama.cpp reserves
    # n_ubatch rows (docs/performance/design.md, "Memory"); it needs one per sequence id.
    params.n_outputs_max = max(slots + draft_rows, params.n_seq_max)
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


def model_meta(model: Any, key: str) -> str | None:
    """A GGUF metadata value of the loaded model, or None."""
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
        name=model_meta(model, "general.name") or os.path.basename(path),
        architecture=model_meta(model, "general.architecture") or "unknown",
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

