"""The ops: what each request asks and how it is answered.

`Ops.handle` dispatches a decoded request with `match`; generate and chat go to
`admission.Admission`, which queues them as a `Generation`. What the ops read of the
running daemon is the `ServerState` they are given; what they write goes into the
connection's reply slots.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from typing import assert_never

import msgspec

from sfcore_daemon import __version__
from sfcore_daemon.config import Config
from sfcore_daemon.core import errors
from sfcore_daemon.core.admission import Admission, Refused, off_loop_if_long
from sfcore_daemon.core.counts import (
    CacheSettings,
    EffectiveConfig,
    ModelDescription,
    SlotUse,
    SpeculativeSettings,
    StoredState,
    Versions,
)
from sfcore_daemon.core.metrics import exposition
from sfcore_daemon.core.request import RequestId
from sfcore_daemon.core.scheduler import Scheduler
from sfcore_daemon.core.state import ServerState
from sfcore_daemon.core.stats import Stats
from sfcore_daemon.core.threads import thread_counts
from sfcore_daemon.engine.thread import Engine
from sfcore_daemon.llama.gpu import gpu_layers
from sfcore_daemon.llama.model import EngineClosed, TokenIdError
from sfcore_daemon.ndjson import protocol
from sfcore_daemon.ndjson.connection import Connection, GenerationReply, ReplySlot
from sfcore_daemon.ndjson.protocol import (
    CacheReply,
    CacheRequest,
    CancelledReply,
    CancelRequest,
    ChatOp,
    DetokenizeRequest,
    GenerateOp,
    HealthReply,
    HealthRequest,
    InfoReply,
    InfoRequest,
    MetricsReply,
    MetricsRequest,
    Request,
    StatsReply,
    StatsRequest,
    TextReply,
    TokenizeRequest,
    TokensReply,
)
from sfcore_daemon.store.promptstore import Cleared

log = logging.getLogger(__name__)

# The cache op's preview of a stored prefix: its first tokens, cut to this many characters.
_PREVIEW_TOKENS = 32
_PREVIEW_CHARS = 80
# A clear waits for the writes queued before it (a few ms each); a disk that hangs
# longer than this gets the client an error instead of a hung request.
_CLEAR_TIMEOUT_S = 60.0


class Ops:
    """The op handlers, over the state they are given; a connection's owner (it hands
    each decoded request to `handle`)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.admission = Admission(state)

    @property
    def config(self) -> Config:
        return self.state.config

    @property
    def stats(self) -> Stats:
        return self.state.stats

    @property
    def scheduler(self) -> Scheduler | None:
        return self.state.scheduler

    async def handle(self, connection: Connection, request: Request, arrived_ns: int) -> bool:
        """Answer one decoded request; False when the connection must close after it."""
        request_id = request.id
        assert request_id is not None  # decode_request assigns one
        self.stats.count_request(protocol.op_name(request), "ndjson")
        # Ops that answer later hold their place in the reply order from here on; an
        # error of ours is answered in that place, never in a new one behind it.
        slot: ReplySlot | None = None
        try:
            match request:
                case HealthRequest():
                    connection.reply(protocol.encode_line(self.health(request_id)))
                case CancelRequest():
                    connection.reply(protocol.encode_line(self.cancel(connection, request)))
                case _ if self.state.draining:
                    connection.reply_error(
                        request_id, errors.SHUTTING_DOWN,
                        "the daemon is shutting down and takes no new requests")
                    return False
                case GenerateOp() | ChatOp():
                    slot = connection.open_slot()
                    try:
                        await self.admission.admit(
                            request, GenerationReply(slot, request_id), arrived_ns)
                    except Refused as refusal:
                        connection.reply_error(request_id, refusal.code, refusal.message, slot)
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
                        connection.reply_error(request_id, errors.SHUTTING_DOWN, str(exc), slot)
                    else:
                        slot.write(protocol.encode_line(info))
                        slot.close()
                case StatsRequest():
                    engine = self.state.engine
                    snapshot = self.stats.snapshot(
                        self.slot_uses(), engine.store if engine else None,
                        thread_counts(engine.threads if engine else None),
                        engine.cost_drift if engine else None)
                    connection.reply(protocol.encode_line(
                        StatsReply(id=request_id, **msgspec.structs.asdict(snapshot))))
                case MetricsRequest():
                    connection.reply(protocol.encode_line(
                        MetricsReply(id=request_id, text=exposition(self.state))))
                case CacheRequest():
                    slot = connection.open_slot()
                    await self.cache(connection, request, slot)
                case _:
                    assert_never(request)
        except Exception:
            # A bug of ours must not cost the client its connection or other requests.
            log.exception("request %r failed", request_id)
            if slot is None or not slot.complete:
                connection.reply_error(request_id, errors.INTERNAL,
                                       "unexpected error in the daemon; see its log", slot)
        return True

    def health(self, request_id: RequestId) -> HealthReply:
        state, scheduler = self.state, self.scheduler
        return HealthReply(
            id=request_id,
            status=state.status,  # type: ignore[arg-type]
            model=state.engine.info.name if state.engine is not None else "",
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
            for generation in connection.unanswered(request.target):
                found = True
                scheduler.cancel(generation)
        assert request.id is not None
        return CancelledReply(id=request.id, target=request.target, found=found)

    async def info(self, request_id: RequestId) -> InfoReply:
        engine = await self.state.loaded_engine()
        info, model_config, template = engine.info, self.config.model, self.state.chat_template
        return InfoReply(
            id=request_id,
            model=ModelDescription(
                path=info.path, name=info.name, architecture=info.architecture,
                n_params=info.n_params, n_ctx_train=info.n_ctx_train, n_vocab=info.n_vocab,
                size_bytes=info.size_bytes, has_chat_template=info.chat_template is not None),
            config=EffectiveConfig(
                n_ctx=engine.n_ctx, kv_bytes=engine.context_size.kv_bytes,
                threads=engine.n_threads,
                threads_batch=engine.n_threads_batch, batch=model_config.n_batch,
                ubatch=engine.n_ubatch, cpu_affinity=list(self.state.cpus),
                mmap=model_config.use_mmap, mlock=model_config.use_mlock,
                huge_page_bytes=engine.huge_pages.huge_bytes,
                gpu_layers=gpu_layers(model_config.n_gpu_layers),
                flash_attn=model_config.flash_attn,
                reproducible=model_config.reproducible,
                slots=engine.slots, prefill_per_step=self.config.server.prefill_per_step,
                speculative=self._speculative_settings(engine),
                cache=self._cache_settings(engine),
                chat_template=template.label if template else None),
            system_info=engine.system_info.strip(),
            versions=_versions(),
        )

    async def tokenize(self, connection: Connection, request: TokenizeRequest,
                       slot: ReplySlot) -> None:
        request_id = request.id
        try:
            engine = await self.state.loaded_engine()
            tokens = await off_loop_if_long(
                len(request.text), engine.tokenize, request.text, request.add_special)
        except EngineClosed:
            connection.reply_error(request_id, errors.SHUTTING_DOWN,
                                   "the daemon is shutting down", slot)
            return
        assert request_id is not None
        slot.write(protocol.encode_line(TokensReply(id=request_id, tokens=tokens)))
        slot.close()

    async def detokenize(self, connection: Connection, request: DetokenizeRequest,
                         slot: ReplySlot) -> None:
        request_id = request.id
        try:
            engine = await self.state.loaded_engine()
            text = await off_loop_if_long(4 * len(request.tokens), engine.detokenize,
                                           request.tokens)
        except TokenIdError as exc:
            connection.reply_error(request_id, errors.INVALID_REQUEST, str(exc), slot)
            return
        except EngineClosed:
            connection.reply_error(request_id, errors.SHUTTING_DOWN,
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
            engine = await self.state.loaded_engine()
        except EngineClosed as exc:
            connection.reply_error(request_id, errors.SHUTTING_DOWN, str(exc), slot)
            return
        store = engine.store
        removed = Cleared(states=0, files=0, bytes=0)
        if store is not None and request.action == "clear":
            try:
                removed = await asyncio.wait_for(asyncio.wrap_future(store.clear()),
                                                 _CLEAR_TIMEOUT_S)
            except TimeoutError:
                connection.reply_error(
                    request_id, errors.INTERNAL,
                    f"the prompt store did not finish clearing in {_CLEAR_TIMEOUT_S:.0f} s "
                    "(its disk is slow or hung); it goes on in the background", slot)
                return
        states = []
        for stored in store.states(_PREVIEW_TOKENS) if store is not None else []:
            try:
                preview = engine.detokenize(stored.tokens)[:_PREVIEW_CHARS]
            except EngineClosed:
                preview = ""
            states.append(StoredState(tokens=stored.n_tokens, bytes=stored.nbytes,
                                      ram=stored.ram, disk=stored.disk, preview=preview,
                                      pinned_s=stored.pinned_s))
        folder = store.folder if store is not None else None
        slot.write(protocol.encode_line(CacheReply(
            id=request_id, enabled=store is not None,
            dir=str(folder) if folder is not None else None, states=states,
            removed_states=removed.states, removed_files=removed.files,
            removed_bytes=removed.bytes)))
        slot.close()

    def _speculative_settings(self, engine: Engine) -> SpeculativeSettings:
        settings = self.config.speculative
        return SpeculativeSettings(
            mode=settings.mode if self.state.speculates else "off",
            draft_max=settings.draft_max, draft_start=settings.draft_start,
            ngram_max=settings.ngram_max, ngram_min=settings.ngram_min,
            store_tokens=settings.store_tokens, row_multiple=settings.row_multiple,
            policy=settings.policy,
            step_costs=engine.step_cost_ratios())

    def _cache_settings(self, engine: Engine) -> CacheSettings:
        config = self.config.cache
        store = engine.store
        return CacheSettings(
            enabled=store is not None,
            dir=str(store.root) if store is not None and store.root is not None else None,
            ram_mb=store.ram_budget >> 20 if store is not None else 0,
            disk_mb=store.disk_budget >> 20 if store is not None else 0,
            min_tokens=config.min_tokens)


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
