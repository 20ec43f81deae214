"""The ops: what each request asks and how it is answered.

`RequestHandlers.handle` dispatches a decoded request with `match`; generate and chat
become a `Generation` handed to the scheduler. The server state they read (config,
engine, scheduler, stats) is the `Server`'s, which inherits these handlers.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, assert_never

from sfcore_daemon import __version__
from sfcore_daemon.config import Config
from sfcore_daemon.engine.thread import Engine
from sfcore_daemon.llama.gpu import gpu_layers
from sfcore_daemon.llama.model import EngineClosed, TokenIdError
from sfcore_daemon.llama.sampling import Sampling
from sfcore_daemon.serve import protocol
from sfcore_daemon.serve.chat import ChatTemplate, ChatTemplateError
from sfcore_daemon.serve.connection import Connection, ReplySlot
from sfcore_daemon.serve.protocol import (
    CacheReply,
    CacheRequest,
    CacheSettings,
    CancelledReply,
    CancelRequest,
    ChatRequest,
    DetokenizeRequest,
    EffectiveConfig,
    GenerateRequest,
    GenerationRequest,
    HealthReply,
    HealthRequest,
    InfoReply,
    InfoRequest,
    ModelDescription,
    Request,
    RequestId,
    SlotUse,
    SpeculativeSettings,
    StatsRequest,
    StoredState,
    TextReply,
    TokenizeRequest,
    TokensReply,
    Versions,
)
from sfcore_daemon.serve.scheduler import Generation, QueueFull, Scheduler
from sfcore_daemon.serve.stats import Stats
from sfcore_daemon.store.promptstore import Cleared
from sfcore_daemon.structured.compiler import compile_json_object, compile_schema
from sfcore_daemon.structured.gbnfcheck import check_gbnf
from sfcore_daemon.structured.grammar import GrammarError, GrammarSampler
from sfcore_daemon.structured.shape import Shape

log = logging.getLogger(__name__)

# Prompts above this size are tokenized off the event loop (about a millisecond of C work).
_INLINE_TOKENIZE_BYTES = 32 * 1024
# The cache op's preview of a stored prefix: its first tokens, cut to this many characters.
_PREVIEW_TOKENS = 32
_PREVIEW_CHARS = 80
# A clear waits for the writes queued before it (a few ms each); a disk that hangs
# longer than this gets the client an error instead of a hung request.
_CLEAR_TIMEOUT_S = 60.0


class RequestHandlers:
    """The op handlers; mixed into `Server`, whose state they use."""

    config: Config
    cpus: list[int]
    engine: Engine | None
    scheduler: Scheduler | None
    chat_template: ChatTemplate | None
    stats: Stats
    draining: bool
    ready: asyncio.Event
    _load_ended: asyncio.Event

    async def handle(self, connection: Connection, request: Request, arrived_ns: int) -> bool:
        """Answer one decoded request; False when the connection must close after it."""
        request_id = request.id
        assert request_id is not None  # decode_request assigns one
        self.stats.by_op[protocol.op_name(request)] += 1
        # Ops that answer later hold their place in the reply order from here on; an
        # error of ours is answered in that place, never in a new one behind it.
        slot: ReplySlot | None = None
        try:
            match request:
                case HealthRequest():
                    connection.reply(protocol.encode_line(self.health(request_id)))
                case CancelRequest():
                    connection.reply(protocol.encode_line(self.cancel(connection, request)))
                case _ if self.draining:
                    connection.reply_error(
                        request_id, protocol.SHUTTING_DOWN,
                        "the daemon is shutting down and takes no new requests")
                    return False
                case GenerateRequest() | ChatRequest():
                    slot = connection.open_slot()
                    await self.start_generation(connection, request, arrived_ns, slot)
                case TokenizeRequest():
                    slot = connection.open_slot()
                    await self.tokenize(connection, request, slot)
                case DetokenizeRequest():
                    slot = connection.open_slot()
                    await self.detokenize(connection, request, slot)
                case InfoRequest():
                    slot = connection.open_slot()
                    try:
                        info = await self.info(request_id)
                    except EngineClosed as exc:
                        connection.reply_error(request_id, protocol.SHUTTING_DOWN, str(exc), slot)
                    else:
                        slot.write(protocol.encode_line(info))
                        slot.close()
                case StatsRequest():
                    stats = self.stats.reply(request_id, self.slot_uses(),
                                             self.engine.store if self.engine else None)
                    connection.reply(protocol.encode_line(stats))
                case CacheRequest():
                    slot = connection.open_slot()
                    await self.cache(connection, request, slot)
                case _:
                    assert_never(request)
        except Exception:
            # A bug of ours must not cost the client its connection or other requests.
            log.exception("request %r failed", request_id)
            if slot is None or not slot.complete:
                connection.reply_error(request_id, protocol.INTERNAL,
                                       "unexpected error in the daemon; see its log", slot)
        return True

    def health(self, request_id: RequestId) -> HealthReply:
        scheduler = self.scheduler
        status = "draining" if self.draining else "ok" if self.ready.is_set() else "loading"
        return HealthReply(
            id=request_id,
            status=status,  # type: ignore[arg-type]
            model=self.engine.info.name if self.engine is not None else "",
            busy=scheduler.busy if scheduler is not None else False,
            queue_depth=scheduler.queue_depth if scheduler is not None else 0,
            uptime_s=round(time.monotonic() - self.stats.started, 3),
            slots=self.config.server.slots,
            slots_busy=scheduler.busy_slots if scheduler is not None else 0,
        )

    def slot_uses(self) -> list[SlotUse]:
        if self.scheduler is None:
            return [SlotUse(slot=slot, busy=False, requests=0, cached_tokens=0)
                    for slot in range(self.config.server.slots)]
        return self.scheduler.slot_uses()

    def cancel(self, connection: Connection, request: CancelRequest) -> CancelledReply:
        """Cancel the pending requests with id `target` sent on this connection."""
        found = False
        scheduler = self.scheduler
        if scheduler is not None:
            for generation in list(connection.generations):
                if generation.request_id == request.target and not generation.replied:
                    found = True
                    scheduler.cancel(generation)
        assert request.id is not None
        return CancelledReply(id=request.id, target=request.target, found=found)

    async def _loaded_engine(self) -> Engine:
        """The engine once loaded; EngineClosed if the load was given up for a stop."""
        if not self._load_ended.is_set():
            await self._load_ended.wait()
        if self.engine is None:
            raise EngineClosed("the daemon stopped before the model was loaded")
        return self.engine

    async def info(self, request_id: RequestId) -> InfoReply:
        engine = await self._loaded_engine()
        info, model_config = engine.info, self.config.model
        return InfoReply(
            id=request_id,
            model=ModelDescription(
                path=info.path, name=info.name, architecture=info.architecture,
                n_params=info.n_params, n_ctx_train=info.n_ctx_train, n_vocab=info.n_vocab,
                size_bytes=info.size_bytes, has_chat_template=info.chat_template is not None),
            config=EffectiveConfig(
                n_ctx=engine.n_ctx, threads=engine.n_threads,
                threads_batch=engine.n_threads_batch, batch=model_config.n_batch,
                ubatch=engine.n_ubatch, cpu_affinity=list(self.cpus),
                mmap=model_config.use_mmap, mlock=model_config.use_mlock,
                gpu_layers=gpu_layers(model_config.n_gpu_layers),
                flash_attn=model_config.flash_attn,
                reproducible=model_config.reproducible,
                slots=engine.slots, prefill_per_step=self.config.server.prefill_per_step,
                speculative=self._speculative_settings(),
                cache=self._cache_settings(engine),
                chat_template=self.chat_template.label if self.chat_template else None),
            system_info=engine.system_info.strip(),
            versions=_versions(),
        )

    async def tokenize(self, connection: Connection, request: TokenizeRequest,
                       slot: ReplySlot) -> None:
        request_id = request.id
        try:
            engine = await self._loaded_engine()
            tokens = await _off_loop_if_long(
                len(request.text), engine.tokenize, request.text, request.add_special)
        except EngineClosed:
            connection.reply_error(request_id, protocol.SHUTTING_DOWN,
                                   "the daemon is shutting down", slot)
            return
        assert request_id is not None
        slot.write(protocol.encode_line(TokensReply(id=request_id, tokens=tokens)))
        slot.close()

    async def detokenize(self, connection: Connection, request: DetokenizeRequest,
                         slot: ReplySlot) -> None:
        request_id = request.id
        try:
            engine = await self._loaded_engine()
            text = await _off_loop_if_long(4 * len(request.tokens), engine.detokenize,
                                           request.tokens)
        except TokenIdError as exc:
            connection.reply_error(request_id, protocol.INVALID_REQUEST, str(exc), slot)
            return
        except EngineClosed:
            connection.reply_error(request_id, protocol.SHUTTING_DOWN,
                                   "the daemon is shutting down", slot)
            return
        assert request_id is not None
        slot.write(protocol.encode_line(TextReply(id=request_id, text=text)))
        slot.close()

    async def cache(self, connection: Connection, request: CacheRequest,
                    slot: ReplySlot) -> None:
        """List the prompt store's states, or clear it (RAM and this model's files)."""
        request_id = request.id
        assert request_id is not None
        try:
            engine = await self._loaded_engine()
        except EngineClosed as exc:
            connection.reply_error(request_id, protocol.SHUTTING_DOWN, str(exc), slot)
            return
        store = engine.store
        removed = Cleared(states=0, files=0, bytes=0)
        if store is not None and request.action == "clear":
            try:
                removed = await asyncio.wait_for(asyncio.wrap_future(store.clear()),
                                                 _CLEAR_TIMEOUT_S)
            except TimeoutError:
                connection.reply_error(
                    request_id, protocol.INTERNAL,
                    f"the prompt store did not finish clearing in {_CLEAR_TIMEOUT_S:.0f} s "
                    "(its disk is slow or hung); it goes on in the background", slot)
                return
        states = []
        for state in store.states(_PREVIEW_TOKENS) if store is not None else []:
            try:
                preview = engine.detokenize(state.tokens)[:_PREVIEW_CHARS]
            except EngineClosed:
                preview = ""
            states.append(StoredState(tokens=state.n_tokens, bytes=state.nbytes, ram=state.ram,
                                      disk=state.disk, preview=preview))
        folder = store.folder if store is not None else None
        slot.write(protocol.encode_line(CacheReply(
            id=request_id, enabled=store is not None,
            dir=str(folder) if folder is not None else None, states=states,
            removed_states=removed.states, removed_files=removed.files,
            removed_bytes=removed.bytes)))
        slot.close()

    async def _prompt(self, engine: Engine, request: GenerationRequest) -> list[int]:
        """The request's prompt tokens; ChatTemplateError if a chat cannot be rendered."""
        if isinstance(request, GenerateRequest):
            return await _off_loop_if_long(len(request.prompt), engine.tokenize, request.prompt)
        template = self.chat_template
        if template is None:
            raise ChatTemplateError(
                f"chat needs a chat template: the model ({engine.info.architecture}) has none "
                "of its own and model.chat_template names none (set it to a llama.cpp "
                "built-in name such as \"chatml\", or to a Jinja template)")
        messages = [(message.role, message.content) for message in request.messages]
        size = sum(len(content) for _, content in messages)
        return await _off_loop_if_long(
            size, lambda: engine.tokenize_segments(template.render(messages)))

    async def start_generation(self, connection: Connection, request: GenerationRequest,
                               arrived_ns: int, slot: ReplySlot) -> None:
        request_id = request.id
        assert request_id is not None

        def refuse(code: str, message: str) -> None:
            self.stats.by_outcome["error"] += 1
            connection.reply_error(request_id, code, message, slot)

        try:
            # Checking and converting take about a millisecond per 2 KB of grammar (a
            # second for a schema of a megabyte): a worker thread, unless it is small.
            spec = (await asyncio.to_thread(request_grammar, request)
                    if _long_grammar(request) else request_grammar(request))
            engine = await self._loaded_engine()
            prompt = await self._prompt(engine, request)
            grammar = (GrammarSampler.create(engine.loaded_model(), spec.text, spec.field,
                                             prompt, self.config.server.grammar_budget_s,
                                             shape=spec.shape)
                       if spec is not None else None)
        except (ChatTemplateError, GrammarError) as exc:
            refuse(protocol.INVALID_REQUEST, str(exc))
            return
        except EngineClosed:
            refuse(protocol.SHUTTING_DOWN, "the daemon is shutting down")
            return
        if len(prompt) >= engine.n_ctx:
            refuse(protocol.CONTEXT_OVERFLOW,
                   f"the prompt is {len(prompt)} tokens and the context holds {engine.n_ctx} "
                   "(model.n_ctx); no room is left for a reply")
            return
        if connection.gone:
            self.stats.by_outcome["cancelled"] += 1
            return
        if self.draining:
            refuse(protocol.SHUTTING_DOWN, "the daemon is shutting down")
            return
        scheduler = self.scheduler
        assert scheduler is not None
        defaults = self.config.generation
        generation = Generation(
            request_id=request_id,
            stream=request.stream,
            stops=request.stop_sequences,
            prompt=prompt,
            sampling=Sampling(
                temperature=_pick(request.temperature, defaults.temperature),
                top_k=_pick(request.top_k, defaults.top_k),
                top_p=_pick(request.top_p, defaults.top_p),
                min_p=_pick(request.min_p, defaults.min_p),
                repeat_penalty=_pick(request.repeat_penalty, defaults.repeat_penalty),
                seed=request.seed,
            ),
            # Clipped to the room the prompt leaves, so the scheduler can reserve it.
            max_tokens=min(_pick(request.max_tokens, defaults.max_tokens),
                           engine.n_ctx - len(prompt)),
            cache_prompt=request.cache_prompt,
            sink=slot,
            arrived_ns=arrived_ns,
            loop=asyncio.get_running_loop(),
            stats=self.stats,
            exclusive=self._exclusive(request),
            grammar=grammar,
            speculative=request.speculative and self._speculates,
        )
        slot.generation = generation
        connection.generations.add(generation)
        try:
            scheduler.submit(generation)
        except QueueFull:
            connection.generations.discard(generation)
            generation.fail(protocol.QUEUE_FULL,
                            f"every slot is busy and {scheduler.queue_depth} requests are waiting "
                            "(server.max_queue)")


    @property
    def _speculates(self) -> bool:
        return self.config.speculative.mode != "off" and not self.config.model.reproducible

    def _speculative_settings(self) -> SpeculativeSettings:
        settings = self.config.speculative
        return SpeculativeSettings(
            mode=settings.mode if self._speculates else "off",
            draft_max=settings.draft_max, draft_start=settings.draft_start,
            ngram_max=settings.ngram_max, ngram_min=settings.ngram_min,
            store_tokens=settings.store_tokens, row_multiple=settings.row_multiple)

    def _cache_settings(self, engine: Engine) -> CacheSettings:
        config = self.config.cache
        store = engine.store
        return CacheSettings(
            enabled=store is not None,
            dir=str(store.root) if store is not None and store.root is not None else None,
            ram_mb=store.ram_budget >> 20 if store is not None else 0,
            disk_mb=store.disk_budget >> 20 if store is not None else 0,
            min_tokens=config.min_tokens)

    def _exclusive(self, request: GenerationRequest) -> bool:
        """Whether a request must have the batch to itself: in reproducible mode its
        bytes must not depend on what else runs. (A `cache_prompt: false` request only
        skips prefix reuse: letting one client empty the batch and every slot's cache
        at will would let it serialise the daemon.)"""
        return self.config.model.reproducible


_T = TypeVar("_T")


class GrammarSpec(NamedTuple):
    """What a request's output is held to: GBNF text, the field it came from, and for a
    JSON document the shape budget-aware closing completes (None for a GBNF grammar)."""

    text: str
    field: str
    shape: Shape | None


def request_grammar(request: GenerationRequest) -> GrammarSpec | None:
    """The grammar a request asks for, or None when the request is unconstrained."""
    given = [name for name in ("json_schema", "format", "grammar")
             if getattr(request, name) is not None]
    if len(given) > 1:
        raise GrammarError(f"json_schema, format and grammar exclude each other; "
                           f"this request gives {' and '.join(given)}")
    if request.json_schema is not None:
        compiled = compile_schema(request.json_schema)
        return GrammarSpec(compiled.gbnf, "json_schema", compiled.shape)
    if request.format is not None:
        compiled = compile_json_object()
        return GrammarSpec(compiled.gbnf, "format", compiled.shape)
    if request.grammar is not None:
        check_gbnf(request.grammar)
        return GrammarSpec(request.grammar, "grammar", None)
    return None


def _pick(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _long_grammar(request: GenerationRequest) -> bool:
    """Whether checking the request's grammar may take more than about a millisecond (a
    schema's grammar is not known before it is converted: taken as long)."""
    return request.json_schema is not None or len(request.grammar or "") > 2048


async def _off_loop_if_long(size: int, function: Callable[..., _T], *args: Any) -> _T:
    """Run a tokenizer call inline, or in a worker thread when `size` (bytes of text)
    would keep the event loop busy for more than about a millisecond."""
    if size > _INLINE_TOKENIZE_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


_versions_cache: list[Versions] = []


def _versions() -> Versions:
    if not _versions_cache:
        from sfcore_daemon.llama.model import llama_cpp_version

        try:
            bindings = importlib.metadata.version("llama_cpp_python")
        except importlib.metadata.PackageNotFoundError:
            bindings = "unknown"
        _versions_cache.append(Versions(sfcore=__version__, llama_cpp_python=bindings,
                                        llama_cpp=llama_cpp_version()))
    return _versions_cache[0]
