"""The Unix socket, its connections, and an ordered shutdown.

`Server` owns the listening socket, every connection and the engine. A
`Connection` reads NDJSON lines and answers each request in full, in the order the
requests arrived, even when they are pipelined: each request gets a `ReplySlot`
in the connection's outbox, and only the slot at the head writes to the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.metadata
import logging
import select
import signal
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, assert_never

from . import __version__, protocol, systemd
from .chat import ChatTemplate, ChatTemplateError, resolve_template
from .config import Config
from .engine import Engine, EngineClosed, LoadAborted, Sampling, TokenIdError
from .grammar import GrammarError, GrammarSampler, request_gbnf
from .protocol import (
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
    RequestError,
    RequestId,
    SlotUse,
    StatsRequest,
    TextReply,
    TokenizeRequest,
    TokensReply,
    Versions,
)
from .scheduler import Generation, QueueFull, Scheduler
from .socketfile import ListeningSocket, StartupError
from .stats import Stats

log = logging.getLogger(__name__)

# Prompts above this size are tokenized off the event loop (about a millisecond of C work).
_INLINE_TOKENIZE_BYTES = 32 * 1024
_CLOSE_GRACE_S = 5.0
_READ_CHUNK_BYTES = 64 * 1024
# SO_PEERGROUPS (Linux 4.13+): the peer's supplementary groups at connect time.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def _peer_credentials(sock: Any) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the peer process, from SO_PEERCRED."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def _peer_groups(sock: Any) -> set[int]:
    """The peer's supplementary groups (SO_PEERGROUPS); empty if the kernel can't say."""
    size = 4 * 64
    while size <= 4 * 65536:
        try:
            data = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                size *= 4
                continue
            return set()
        return set(struct.unpack(f"{len(data) // 4}I", data[: len(data) // 4 * 4]))
    return set()


def _peer_hung_up(sock: Any) -> bool:
    """After EOF: did the peer close entirely (POLLHUP), or only shut down its writing side?"""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


# --- per connection -----------------------------------------------------------------------


class ReplySlot:
    """The reply lines of one request; written through only while it heads the outbox."""

    __slots__ = ("_connection", "held", "complete", "generation")

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self.held: list[bytes] = []
        self.complete = False
        # The generation writing here, forgotten by the connection once it is answered.
        self.generation: Generation | None = None

    def write(self, data: bytes | bytearray) -> None:
        connection = self._connection
        if connection.gone:
            return
        if connection.outbox[0] is self:
            connection.send(data)
        else:
            self.held.append(bytes(data))
            connection.held_bytes += len(data)
            connection.update_flow()

    def close(self) -> None:
        if not self.complete:
            self.complete = True
            if self.generation is not None:
                self._connection.generations.discard(self.generation)
            self._connection.advance()


class Connection:
    """One client. Reads request lines and answers each in full, in arrival order.

    Flow control: past `max_pending_requests` unanswered requests, or
    `max_output_buffer_bytes` of replies held behind an unfinished one, the
    connection is not read until that drops, so what a client pipelines can never
    make the daemon's memory grow without bound.
    """

    def __init__(self, server: Server, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.transport = writer.transport
        self.outbox: deque[ReplySlot] = deque()
        self.generations: set[Generation] = set()
        self.gone = False
        self.replies_done = asyncio.Event()
        self.replies_done.set()
        # Bytes of finished replies waiting behind the head of the outbox.
        self.held_bytes = 0
        self.may_read = asyncio.Event()
        self.may_read.set()
        # When data last arrived or the last request was answered (idle timeout).
        self.last_activity = time.monotonic()

    # --- output ---

    def open_slot(self) -> ReplySlot:
        slot = ReplySlot(self)
        self.outbox.append(slot)
        self.replies_done.clear()
        self.update_flow()
        return slot

    def reply(self, line: bytes) -> None:
        slot = self.open_slot()
        slot.write(line)
        slot.close()

    def reply_error(self, request_id: RequestId | None, code: str, message: str,
                    slot: ReplySlot | None = None) -> None:
        """An error line, in `slot` if the request already has one."""
        self.server.stats.errors[code] += 1
        line = protocol.error_line(
            request_id if request_id is not None else protocol.assign_id(), code, message)
        if slot is None:
            self.reply(line)
        else:
            slot.write(line)
            slot.close()

    def send(self, data: bytes | bytearray) -> None:
        transport = self.transport
        if transport.is_closing():
            self.drop("connection closed")
            return
        transport.write(data)
        if transport.get_write_buffer_size() > self.server.config.server.max_output_buffer_bytes:
            self.drop("client stopped reading (unread output over server.max_output_buffer_bytes)")

    def advance(self) -> None:
        outbox = self.outbox
        while outbox and outbox[0].complete:
            outbox.popleft()
            if outbox and not self.gone:
                head = outbox[0]
                for data in head.held:
                    self.held_bytes -= len(data)
                    self.send(data)
                head.held.clear()
        if not outbox:
            self.replies_done.set()
            self.last_activity = time.monotonic()
        self.update_flow()

    def update_flow(self) -> None:
        limits = self.server.config.server
        if self.gone or (len(self.outbox) < limits.max_pending_requests
                         and self.held_bytes <= limits.max_output_buffer_bytes):
            self.may_read.set()
        else:
            self.may_read.clear()

    def drop(self, reason: str) -> None:
        """Give up on this client: cancel its work and close without further output."""
        if self.gone:
            return
        self.gone = True
        log.info("dropping connection: %s", reason)
        scheduler = self.server.scheduler
        if scheduler is not None:  # generations exist only once the model is loaded
            for generation in list(self.generations):
                scheduler.abandon(generation)
        self.outbox.clear()
        self.held_bytes = 0
        self.replies_done.set()
        self.may_read.set()
        self.transport.abort()

    # --- input ---

    async def serve(self) -> None:
        """Split the byte stream into lines and answer them; returns when done with it."""
        limits = self.server.config.server
        max_line = limits.max_line_bytes
        buffer = bytearray()
        scanned = 0  # bytes of `buffer` known to hold no newline
        while not self.gone:
            newline = buffer.find(b"\n", scanned)
            if newline == -1 and len(buffer) <= max_line:
                scanned = len(buffer)
                chunk = await self._read_chunk()
                if chunk is None:
                    return
                if chunk:
                    buffer += chunk
                    continue
                # EOF: a last line without its newline still counts.
                if buffer and not await self._line(bytes(buffer)):
                    await self.close_after_replies()
                    return
                await self._after_eof()
                return
            if newline == -1 or newline > max_line:
                # Nothing after the cut is executed: the rest of the stream is unread.
                self.reply_error(None, protocol.LINE_TOO_LONG,
                                 f"line longer than server.max_line_bytes ({max_line} bytes); "
                                 "closing the connection")
                await self.close_after_replies()
                return
            line = bytes(buffer[:newline + 1])
            del buffer[:newline + 1]
            scanned = 0
            if not await self._line(line):
                await self.close_after_replies()
                return

    async def _line(self, line: bytes) -> bool:
        if not self.may_read.is_set():
            await self.may_read.wait()
            if self.gone:
                return False
        return await self.handle_line(line, time.perf_counter_ns())

    async def _read_chunk(self) -> bytes | None:
        """The next bytes from the client (b"" at EOF), or None once the connection is
        closed: the client left, or it sent nothing for `idle_timeout_s` while no
        request of its was in flight."""
        idle_timeout = self.server.config.server.idle_timeout_s
        while not self.gone:
            if not self.may_read.is_set():
                await self.may_read.wait()
                continue
            wait = None
            if idle_timeout > 0:
                wait = idle_timeout
                if not self.outbox:
                    wait -= time.monotonic() - self.last_activity
                    if wait <= 0:
                        log.info("closing a connection idle for %.1f s (server.idle_timeout_s)",
                                 idle_timeout)
                        self.gone = True
                        self.transport.close()
                        return None
            try:
                async with asyncio.timeout(wait):
                    chunk = await self.reader.read(_READ_CHUNK_BYTES)
            except TimeoutError:
                continue  # re-check: a request may be in flight, or time may be up
            except (ConnectionError, OSError):
                self.drop("connection lost")
                return None
            self.last_activity = time.monotonic()
            return chunk
        return None

    async def handle_line(self, line: bytes, arrived_ns: int) -> bool:
        """Answer one line; False when the connection must close after its replies."""
        if not line.strip():
            return True
        server = self.server
        server.stats.requests_total += 1
        try:
            request = protocol.decode_request(line)
        except RequestError as exc:
            self.reply_error(exc.request_id, exc.code, exc.message)
            return True
        request_id = request.id
        assert request_id is not None  # decode_request assigns one
        server.stats.by_op[protocol.op_name(request)] += 1
        try:
            match request:
                case HealthRequest():
                    self.reply(protocol.encode_line(server.health(request_id)))
                case CancelRequest():
                    self.reply(protocol.encode_line(server.cancel(self, request)))
                case _ if server.draining:
                    self.reply_error(request_id, protocol.SHUTTING_DOWN,
                                     "the daemon is shutting down and takes no new requests")
                    return False
                case GenerateRequest() | ChatRequest():
                    await server.start_generation(self, request, arrived_ns)
                case TokenizeRequest():
                    await server.tokenize(self, request)
                case DetokenizeRequest():
                    await server.detokenize(self, request)
                case InfoRequest():
                    slot = self.open_slot()
                    try:
                        info = await server.info(request_id)
                    except EngineClosed as exc:
                        self.reply_error(request_id, protocol.SHUTTING_DOWN, str(exc), slot)
                    else:
                        slot.write(protocol.encode_line(info))
                        slot.close()
                case StatsRequest():
                    stats = server.stats.reply(request_id, server.slot_uses())
                    self.reply(protocol.encode_line(stats))
                case _:
                    assert_never(request)
        except Exception:
            # A bug of ours must not cost the client its connection or other requests.
            log.exception("request %r failed", request_id)
            self.reply_error(request_id, protocol.INTERNAL,
                             "unexpected error in the daemon; see its log")
        return True

    async def _after_eof(self) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is None or _peer_hung_up(sock):
            self.drop("client disconnected")
            return
        # Only the client's writing side is shut (`socat`, `nc -N`): answer, then close.
        await self.close_after_replies()

    async def close_after_replies(self) -> None:
        """Close once every accepted request is answered, or drop if the client leaves first."""
        if not self.replies_done.is_set():
            # shield: cancelling our wait must not cancel the protocol's own close future.
            closed: asyncio.Future[Any] = asyncio.ensure_future(
                asyncio.shield(_wait_closed(self.writer)))
            replied: asyncio.Future[Any] = asyncio.ensure_future(self.replies_done.wait())
            await asyncio.wait({closed, replied}, return_when=asyncio.FIRST_COMPLETED)
            replied.cancel()
            closed.cancel()
            if not self.replies_done.is_set():
                self.drop("client disconnected")
                return
        if not self.gone:
            self.gone = True
            self.transport.close()


async def _wait_closed(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):  # a reset peer is just a closed peer here
        await writer.wait_closed()


# --- the daemon ---------------------------------------------------------------------------


class Server:
    def __init__(self, config: Config, engine: Engine, cpus: list[int],
                 listening: ListeningSocket) -> None:
        """`engine` has been started (it may still be loading); the server closes it."""
        self.config = config
        self.cpus = cpus
        self._listening = listening
        self.socket_path = listening.path
        self._engine = engine
        # Set once the model is loaded and warmed up.
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.chat_template: ChatTemplate | None = None
        self.stats = Stats()
        self.connections: set[Connection] = set()
        self._connection_tasks: set[asyncio.Task[None]] = set()
        self.draining = False
        self.ready = asyncio.Event()
        # Set when the load has ended either way: requests waiting for the model
        # then run, or are answered `shutting_down` if the load was given up.
        self._load_ended = asyncio.Event()
        self._stop = asyncio.Event()
        self._stop_count = 0
        self._listener: asyncio.AbstractServer | None = None
        self._closing: set[asyncio.Future[None]] = set()
        self._watchdog: asyncio.Task[None] | None = None

    # --- lifecycle ---

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop, signum)
        if self._listening.identity is None:
            log.info("using the socket passed by systemd: %s", self.socket_path)
        try:
            self._start_watchdog()
            self._listener = await asyncio.start_unix_server(self._accept,
                                                             sock=self._listening.sock)
            log.info("listening on %s; loading the model", self.socket_path)
            systemd.notify("STATUS=loading the model")
            if await self._load() and not self._stop.is_set():
                await self._stop.wait()
            await self._shutdown()
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
        return 0

    def _start_watchdog(self) -> None:
        from .watchdog import Watchdog

        engine = self._engine
        watchdog = Watchdog.from_env(
            progress=lambda: engine.progress,
            busy=lambda: not self.ready.is_set() or (
                self.scheduler is not None and self.scheduler.busy),
        )
        if watchdog is not None:
            self._watchdog = asyncio.ensure_future(watchdog.run())

    async def _load(self) -> bool:
        """Wait for the model; False if a stop signal came first (the load is aborted)."""
        engine, model_config = self._engine, self.config.model
        loaded: asyncio.Future[Any] = asyncio.wrap_future(engine.ready)
        stopped: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({loaded, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not loaded.done():
            log.info("stop requested while the model loads; aborting the load")
            engine.abort_load()
            self.draining = True
            self._load_ended.set()
            with contextlib.suppress(LoadAborted):
                await loaded
            return False
        loaded.result()  # a load error ends the daemon here
        info = engine.info
        try:
            self.chat_template = resolve_template(
                model_template=info.chat_template, configured=model_config.chat_template,
                architecture=info.architecture, bos_token=engine.bos_text,
                eos_token=engine.eos_text)
        except ChatTemplateError as exc:
            raise StartupError(f"model.chat_template: {exc}") from None
        self.engine = engine
        self.scheduler = Scheduler(engine, self.config.server.max_queue, engine.slots)
        log.info("model %s (%s, %s parameters, %.1f MB) from %s loaded in %.0f ms",
                 info.name, info.architecture, f"{info.n_params:,}", info.size_bytes / 1e6,
                 info.path, engine.load_seconds * 1000)
        log.info("n_ctx=%d n_batch=%d n_ubatch=%d threads=%d threads_batch=%d cpus=%s "
                 "reproducible=%s chat_template=%s", engine.n_ctx, model_config.n_batch,
                 engine.n_ubatch, engine.n_threads, engine.n_threads_batch, self.cpus,
                 model_config.reproducible,
                 self.chat_template.label if self.chat_template else None)
        log.info("llama.cpp system info: %s", engine.system_info.strip())
        self.ready.set()
        self._load_ended.set()
        systemd.notify(f"READY=1\nSTATUS=serving {info.name} on {self.socket_path}")
        return True

    def request_stop(self, signum: int | None = None) -> None:
        self._stop_count += 1
        if self._stop_count == 1:
            log.info("received %s; draining", signal.Signals(signum).name if signum else "stop")
            self._stop.set()
        elif self.scheduler is not None:
            log.info("second stop signal: cancelling the running request now")
            self.scheduler.cancel_running()

    async def _shutdown(self) -> None:
        self.draining = True
        systemd.notify("STOPPING=1")
        if self._listener is not None:
            self._listener.close()
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.reject_waiting(protocol.SHUTTING_DOWN, "the daemon is shutting down")
        # Connections with nothing running are answered and closed now; the others
        # close once their running request has finished.
        for connection in list(self.connections):
            if not connection.generations:
                self._closing.add(asyncio.ensure_future(connection.close_after_replies()))
        if scheduler is not None:
            try:
                await asyncio.wait_for(scheduler.wait_idle(), self.config.server.drain_timeout_s)
            except TimeoutError:
                log.warning("drain timeout (%.1f s) reached; cancelling the running request",
                            self.config.server.drain_timeout_s)
                scheduler.cancel_running()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(scheduler.wait_idle(), _CLOSE_GRACE_S)
        await self._close_connections()
        # Only now: a request still being tokenized holds the vocabulary, and close()
        # waits for it before freeing the model.
        if not await asyncio.to_thread(self._engine.close):
            log.error("the decode thread did not stop; leaving the model to the OS")
        log.info("stopped")

    async def _close_connections(self) -> None:
        waits = [asyncio.ensure_future(c.replies_done.wait()) for c in self.connections]
        if waits:
            await asyncio.wait(waits, timeout=_CLOSE_GRACE_S)
            for waiter in waits:
                waiter.cancel()
        for connection in list(self.connections):
            connection.gone = True
            connection.may_read.set()
            connection.transport.close()
        tasks = [*self._connection_tasks, *self._closing]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_GRACE_S)

    # --- connections ---

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connection_tasks.add(task)
        connection = Connection(self, reader, writer)
        self.stats.connections_total += 1
        try:
            rejection = self._admission_error(writer)
            if rejection is not None:
                self.stats.connections_rejected += 1
                code, message = rejection
                connection.reply_error(None, code, message)
                await connection.close_after_replies()
                return
            self.connections.add(connection)
            self.stats.connections_current = len(self.connections)
            await connection.serve()
        except asyncio.CancelledError:
            connection.drop("daemon stopping")
        except Exception:
            log.exception("connection handler failed")
            connection.drop("internal error")
        finally:
            self.connections.discard(connection)
            self.stats.connections_current = len(self.connections)
            self._connection_tasks.discard(task)

    def _admission_error(self, writer: asyncio.StreamWriter) -> tuple[str, str] | None:
        server_config = self.config.server
        if self.draining:
            return protocol.SHUTTING_DOWN, "the daemon is shutting down"
        restricted = bool(server_config.allowed_uids or server_config.allowed_gids)
        if restricted or log.isEnabledFor(logging.DEBUG):
            sock = writer.get_extra_info("socket")
            creds = _peer_credentials(sock)
            log.debug("connection from pid/uid/gid %s", creds)
            if restricted:
                if creds is None:
                    return protocol.FORBIDDEN, "cannot read the peer's credentials"
                _, uid, gid = creds
                allowed = uid in server_config.allowed_uids or bool(
                    server_config.allowed_gids
                    and ({gid} | _peer_groups(sock)) & set(server_config.allowed_gids))
                if not allowed:
                    return (protocol.FORBIDDEN, f"uid {uid} (gid {gid}) is not in "
                            "server.allowed_uids and none of its groups in server.allowed_gids")
        if len(self.connections) >= server_config.max_connections:
            return (protocol.TOO_MANY_CONNECTIONS,
                    f"server.max_connections ({server_config.max_connections}) already open")
        return None

    # --- requests ---

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
                gpu_layers=model_config.n_gpu_layers, flash_attn=model_config.flash_attn,
                reproducible=model_config.reproducible,
                slots=engine.slots, prefill_per_step=self.config.server.prefill_per_step,
                chat_template=self.chat_template.label if self.chat_template else None),
            system_info=engine.system_info.strip(),
            versions=_versions(),
        )

    async def tokenize(self, connection: Connection, request: TokenizeRequest) -> None:
        request_id = request.id
        slot = connection.open_slot()
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

    async def detokenize(self, connection: Connection, request: DetokenizeRequest) -> None:
        request_id = request.id
        slot = connection.open_slot()
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
                               arrived_ns: int) -> None:
        request_id = request.id
        assert request_id is not None
        # The slot comes first: from now on the request holds its place in the reply
        # order, and a shutdown waits for its answer.
        slot = connection.open_slot()

        def refuse(code: str, message: str) -> None:
            self.stats.by_outcome["error"] += 1
            connection.reply_error(request_id, code, message, slot)

        try:
            grammar_spec = request_gbnf(request)
            engine = await self._loaded_engine()
            prompt = await self._prompt(engine, request)
            grammar = (GrammarSampler.create(engine, *grammar_spec, prompt)
                       if grammar_spec is not None else None)
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


    def _exclusive(self, request: GenerationRequest) -> bool:
        """Whether a request must have the batch to itself: its tokens must not depend
        on what else runs (reproducible mode; a cold prompt, which promises the same
        bytes for the same seed whatever else runs)."""
        return self.config.model.reproducible or not request.cache_prompt


_T = TypeVar("_T")


def _pick(value: _T | None, default: _T) -> _T:
    return default if value is None else value


async def _off_loop_if_long(size: int, function: Callable[..., _T], *args: Any) -> _T:
    """Run a tokenizer call inline, or in a worker thread when `size` (bytes of text)
    would keep the event loop busy for more than about a millisecond."""
    if size > _INLINE_TOKENIZE_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


_versions_cache: list[Versions] = []


def _versions() -> Versions:
    if not _versions_cache:
        from .engine import llama_cpp_version

        try:
            bindings = importlib.metadata.version("llama_cpp_python")
        except importlib.metadata.PackageNotFoundError:
            bindings = "unknown"
        _versions_cache.append(Versions(sfcore=__version__, llama_cpp_python=bindings,
                                        llama_cpp=llama_cpp_version()))
    return _versions_cache[0]
