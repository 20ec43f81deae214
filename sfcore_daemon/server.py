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
import logging
import os
import select
import signal
import socket
import stat
import struct
import time
from collections import deque
from typing import Any, TypeVar

from . import protocol, systemd
from .config import Config
from .engine import Engine, Sampling
from .protocol import GenerateRequest, HealthReply, HealthRequest, RequestError, RequestId
from .scheduler import Generation, QueueFull, Scheduler

log = logging.getLogger(__name__)

# Prompts above this size are tokenized off the event loop (about a millisecond of C work).
_INLINE_TOKENIZE_BYTES = 32 * 1024
_CLOSE_GRACE_S = 5.0


class StartupError(Exception):
    """A problem that stops the daemon before it serves; the message is for the user."""


# --- the socket file ----------------------------------------------------------------------


def bind_socket(path: str, mode: int) -> socket.socket:
    """Bind a listening socket at `path` with `mode` from the first instant.

    A live daemon on the path is refused; a stale socket (nothing listening) is
    reclaimed; anything that is not a socket is refused and never deleted.
    """
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(existing.st_mode):
            raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
        if _is_listening(path):
            raise StartupError(f"another daemon is already listening on {path}")
        log.info("removing stale socket %s", path)
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The umask, not a chmod after bind, so the file is never more open than `mode`.
    old_umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot bind {path}: {exc.strerror}") from None
    finally:
        os.umask(old_umask)
    sock.listen(512)
    return sock


def _is_listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        raise StartupError(f"cannot tell whether {path} is in use: {exc.strerror}") from None
    finally:
        probe.close()
    return True


def _peer_uid(sock: Any) -> int | None:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])


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

    def close(self) -> None:
        if not self.complete:
            self.complete = True
            if self.generation is not None:
                self._connection.generations.discard(self.generation)
            self._connection.advance()


class Connection:
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

    # --- output ---

    def open_slot(self) -> ReplySlot:
        slot = ReplySlot(self)
        self.outbox.append(slot)
        self.replies_done.clear()
        return slot

    def reply(self, line: bytes) -> None:
        slot = self.open_slot()
        slot.write(line)
        slot.close()

    def reply_error(self, request_id: RequestId | None, code: str, message: str) -> None:
        self.reply(protocol.error_line(request_id if request_id is not None
                                       else protocol.assign_id(), code, message))

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
                    self.send(data)
                head.held.clear()
        if not outbox:
            self.replies_done.set()

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
        self.replies_done.set()
        self.transport.abort()

    # --- input ---

    async def serve(self) -> None:
        reader = self.reader
        while not self.gone:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as eof:
                if self.gone:
                    return
                # A last line without its newline still counts.
                if await self.handle_line(eof.partial, time.perf_counter_ns()):
                    await self._after_eof()
                else:
                    await self.close_after_replies()
                return
            except asyncio.LimitOverrunError:
                limit = self.server.config.server.max_line_bytes
                self.reply_error(None, protocol.LINE_TOO_LONG,
                                 f"line longer than server.max_line_bytes ({limit} bytes); "
                                 "closing the connection")
                await self.close_after_replies()
                return
            except (ConnectionError, OSError):
                self.drop("connection lost")
                return
            if not await self.handle_line(line, time.perf_counter_ns()):
                await self.close_after_replies()
                return

    async def handle_line(self, line: bytes, arrived_ns: int) -> bool:
        """Answer one line; False when the connection must close after its replies."""
        if not line.strip():
            return True
        try:
            request = protocol.decode_request(line)
        except RequestError as exc:
            self.reply_error(exc.request_id, exc.code, exc.message)
            return True
        server = self.server
        try:
            match request:
                case HealthRequest(id=request_id) if request_id is not None:
                    self.reply(protocol.encode_line(server.health(request_id)))
                case _ if server.draining:
                    self.reply_error(request.id, protocol.SHUTTING_DOWN,
                                     "the daemon is shutting down and takes no new requests")
                    return False
                case GenerateRequest():
                    await server.start_generation(self, request, arrived_ns)
        except Exception:
            # A bug of ours must not cost the client its connection or other requests.
            log.exception("request %r failed", request.id)
            self.reply_error(request.id, protocol.INTERNAL,
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
    def __init__(self, config: Config, engine: Engine, cpus: list[int]) -> None:
        """`engine` has been started (it may still be loading); the server closes it."""
        self.config = config
        self.cpus = cpus
        self.socket_path = config.server.resolved_socket_path()
        self._engine = engine
        # Set once the model is loaded and warmed up.
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.connections: set[Connection] = set()
        self._connection_tasks: set[asyncio.Task[None]] = set()
        self.draining = False
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._stop_count = 0
        self._started = time.monotonic()
        self._listener: asyncio.AbstractServer | None = None
        self._socket_identity: tuple[int, int] | None = None
        self._closing: set[asyncio.Future[None]] = set()

    # --- lifecycle ---

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop, signum)
        sock = systemd.activated_socket()
        if sock is None:
            sock = bind_socket(self.socket_path, self.config.server.socket_mode_bits)
            info = os.stat(self.socket_path)
            self._socket_identity = (info.st_dev, info.st_ino)
        else:
            self.socket_path = sock.getsockname() or self.socket_path
            log.info("using the socket passed by systemd: %s", self.socket_path)
        try:
            self._listener = await asyncio.start_unix_server(
                self._accept, sock=sock, limit=self.config.server.max_line_bytes + 1)
            log.info("listening on %s; loading the model", self.socket_path)
            systemd.notify("STATUS=loading the model")
            await self._load()
            if not self._stop.is_set():
                await self._stop.wait()
            await self._shutdown()
        finally:
            self._remove_socket()
        return 0

    async def _load(self) -> None:
        engine, model_config = self._engine, self.config.model
        await asyncio.wrap_future(engine.ready)
        self.engine = engine
        self.scheduler = Scheduler(engine, self.config.server.max_queue)
        info = engine.info
        log.info("model %s (%s, %s parameters, %.1f MB) from %s loaded in %.0f ms",
                 info.name, info.architecture, f"{info.n_params:,}", info.size_bytes / 1e6,
                 info.path, engine.load_seconds * 1000)
        log.info("n_ctx=%d n_batch=%d n_ubatch=%d threads=%d threads_batch=%d cpus=%s "
                 "reproducible=%s", engine.n_ctx, model_config.n_batch, engine.n_ubatch,
                 engine.n_threads, engine.n_threads_batch, self.cpus,
                 model_config.reproducible)
        log.info("llama.cpp system info: %s", engine.system_info.strip())
        self.ready.set()
        systemd.notify(f"READY=1\nSTATUS=serving {info.name} on {self.socket_path}")

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
            connection.transport.close()
        tasks = [*self._connection_tasks, *self._closing]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_GRACE_S)

    def _remove_socket(self) -> None:
        if self._socket_identity is None:
            return  # systemd owns an activated socket
        try:
            info = os.lstat(self.socket_path)
            if (info.st_dev, info.st_ino) == self._socket_identity:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("cannot remove %s: %s", self.socket_path, exc.strerror)

    # --- connections ---

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connection_tasks.add(task)
        connection = Connection(self, reader, writer)
        try:
            rejection = self._admission_error(writer)
            if rejection is not None:
                code, message = rejection
                connection.reply_error(None, code, message)
                await connection.close_after_replies()
                return
            self.connections.add(connection)
            await connection.serve()
        except asyncio.CancelledError:
            connection.drop("daemon stopping")
        except Exception:
            log.exception("connection handler failed")
            connection.drop("internal error")
        finally:
            self.connections.discard(connection)
            self._connection_tasks.discard(task)

    def _admission_error(self, writer: asyncio.StreamWriter) -> tuple[str, str] | None:
        server_config = self.config.server
        if self.draining:
            return protocol.SHUTTING_DOWN, "the daemon is shutting down"
        if server_config.allowed_uids:
            uid = _peer_uid(writer.get_extra_info("socket"))
            if uid not in server_config.allowed_uids:
                return protocol.FORBIDDEN, f"uid {uid} is not in server.allowed_uids"
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
            uptime_s=round(time.monotonic() - self._started, 3),
        )

    async def start_generation(self, connection: Connection, request: GenerateRequest,
                               arrived_ns: int) -> None:
        request_id = request.id
        assert request_id is not None
        if not self.ready.is_set():
            await self.ready.wait()
        engine, scheduler = self.engine, self.scheduler
        assert engine is not None and scheduler is not None
        if len(request.prompt) > _INLINE_TOKENIZE_BYTES:
            prompt = await asyncio.to_thread(engine.tokenize, request.prompt)
        else:
            prompt = engine.tokenize(request.prompt)
        if len(prompt) >= engine.n_ctx:
            connection.reply_error(
                request_id, protocol.CONTEXT_OVERFLOW,
                f"the prompt is {len(prompt)} tokens and the context holds {engine.n_ctx} "
                "(model.n_ctx); no room is left for a reply")
            return
        if self.draining or connection.gone:
            if not connection.gone:
                connection.reply_error(request_id, protocol.SHUTTING_DOWN,
                                       "the daemon is shutting down")
            return
        defaults = self.config.generation
        slot = connection.open_slot()
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
            max_tokens=_pick(request.max_tokens, defaults.max_tokens),
            cache_prompt=request.cache_prompt,
            sink=slot,
            arrived_ns=arrived_ns,
            loop=asyncio.get_running_loop(),
        )
        slot.generation = generation
        connection.generations.add(generation)
        try:
            scheduler.submit(generation)
        except QueueFull:
            connection.generations.discard(generation)
            generation.fail(protocol.QUEUE_FULL,
                            f"the slot is busy and {scheduler.queue_depth} requests are waiting "
                            "(server.max_queue)")


_T = TypeVar("_T")


def _pick(value: _T | None, default: _T) -> _T:
    return default if value is None else value
