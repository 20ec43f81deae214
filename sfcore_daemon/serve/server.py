"""The daemon's state: the listening socket, its connections, and an ordered shutdown.

`Server` owns the listener, every connection and the engine: it admits connections,
waits for the model, and on a stop signal stops accepting, drains with a timeout,
cancels the rest, frees the model and closes the connections. What the ops read of it
is its `ServerState`; the ops themselves are `ops.Ops`, the owner of every connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any, Protocol

from sfcore_daemon.config import Config
from sfcore_daemon.engine.thread import Engine
from sfcore_daemon.llama.model import LoadAborted
from sfcore_daemon.llama.stepcost import BUSY_SHARE
from sfcore_daemon.serve import access, protocol
from sfcore_daemon.serve.chat import ChatTemplateError, TemplateBudgetError, resolve_template
from sfcore_daemon.serve.connection import Connection, peer_credentials, peer_groups
from sfcore_daemon.serve.ops import Ops
from sfcore_daemon.serve.scheduler import Scheduler
from sfcore_daemon.serve.state import ServerState
from sfcore_daemon.serve.threads import ThreadMonitor
from sfcore_daemon.system import logs, openmp, systemd
from sfcore_daemon.system.socketfile import ListeningSocket, StartupError

log = logging.getLogger(__name__)

_CLOSE_GRACE_S = 5.0
# The exit status after the decode thread died (sysexits' EX_SOFTWARE): not 0, so that
# systemd's Restart=on-failure starts the daemon again, and not 2 (a configuration
# error, which the unit does not restart).
EXIT_DECODE_FAILED = 70


class Frontend(Protocol):
    """A listener beside the NDJSON socket (the OpenAI-compatible HTTP one), given to
    the server from above: started with the server, stopped in its shutdown order."""

    def describe(self) -> str:
        """What it serves where, for the ready line."""
        ...

    async def start(self, state: ServerState) -> None: ...

    async def stop_accepting(self) -> None: ...

    async def close(self) -> None:
        """After the drain: close its connections and its socket."""
        ...


def _costs_source(engine: Engine) -> str:
    if not engine.step_costs_measured:
        return "as measured before"
    busy = engine.step_costs_busy
    if busy > BUSY_SHARE:
        return (f"measured in {engine.step_costs_ms:.0f} ms while other processes used "
                f"{busy:.0%} of the CPUs: for this run only, measured again at the next start")
    return f"measured in {engine.step_costs_ms:.0f} ms, kept for later starts"


class Server:
    def __init__(self, config: Config, engine: Engine, cpus: list[int],
                 listening: ListeningSocket, frontends: Sequence[Frontend] = ()) -> None:
        """`engine` has been started (it may still be loading); the server closes it."""
        self.config = config
        self._frontends = tuple(frontends)
        self._listening = listening
        self.socket_path = listening.path
        # Started, maybe still loading; `state.engine` once loaded.
        self._engine = engine
        self.state = ServerState(config, cpus)
        self.ops = Ops(self.state)
        self.connections: set[Connection] = set()
        self._connection_tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._stop_count = 0
        self._listener: asyncio.AbstractServer | None = None
        self._closing: set[asyncio.Future[None]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._thread_monitor: asyncio.Task[None] | None = None
        # Set when the decode thread died while serving: the daemon answers everything
        # with an error and exits with EXIT_DECODE_FAILED.
        self.failed = False

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
            for frontend in self._frontends:
                await frontend.start(self.state)
            log.info("listening on %s; loading the model", self.socket_path)
            systemd.notify("STATUS=loading the model")
            if await self._load() and not self._stop.is_set():
                await self._stop.wait()
            await self._shutdown()
        finally:
            for task in (self._watchdog, self._thread_monitor):
                if task is not None:
                    task.cancel()
        return EXIT_DECODE_FAILED if self.failed else 0

    def _start_watchdog(self) -> None:
        from sfcore_daemon.system.watchdog import Watchdog

        engine, state = self._engine, self.state
        watchdog = Watchdog.from_env(
            progress=lambda: engine.progress,
            busy=lambda: not state.ready.is_set() or (
                state.scheduler is not None and state.scheduler.busy),
        )
        if watchdog is not None:
            self._watchdog = asyncio.ensure_future(watchdog.run())

    async def _load(self) -> bool:
        """Wait for the model; False if a stop signal came first (the load is aborted)."""
        engine, model_config, state = self._engine, self.config.model, self.state
        loaded: asyncio.Future[Any] = asyncio.wrap_future(engine.ready)
        stopped: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({loaded, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not loaded.done():
            log.info("stop requested while the model loads; aborting the load")
            engine.abort_load()
            state.draining = True
            state.load_ended.set()
            with contextlib.suppress(LoadAborted):
                await loaded
            return False
        loaded.result()  # a load error ends the daemon here
        info = engine.info
        try:
            state.chat_template = resolve_template(
                model_template=info.chat_template, configured=model_config.chat_template,
                architecture=info.architecture, bos_token=engine.bos_text,
                eos_token=engine.eos_text)
        except TemplateBudgetError as exc:
            # The model's own template is tried first, so it is the one, if it has one.
            source = (f"the chat template in {info.path}" if info.chat_template
                      else "model.chat_template")
            raise StartupError(f"{source}: refused: {exc} on a four-message chat") from None
        except ChatTemplateError as exc:
            raise StartupError(f"model.chat_template: {exc}") from None
        state.engine = engine
        state.scheduler = Scheduler(engine, self.config.server.max_queue, engine.slots)
        if engine.threads.adaptive:
            self._thread_monitor = asyncio.ensure_future(
                ThreadMonitor(engine.threads, state.scheduler, state.cpus).run())
        loop = asyncio.get_running_loop()

        def decode_stopped(future: concurrent.futures.Future[None]) -> None:
            # On the decode thread: only hand it over. A closed loop means the daemon
            # has already stopped.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._decode_stopped, future)

        engine.stopped.add_done_callback(decode_stopped)
        log.info("model %s (%s, %s parameters, %.1f MB) from %s loaded in %.0f ms; "
                 "warm-up batch decoded in %.0f ms", info.name, info.architecture,
                 f"{info.n_params:,}", info.size_bytes / 1e6, info.path,
                 engine.load_seconds * 1000, engine.warm_up_ms)
        log.info("%s", engine.loaded_model().placement)
        log.info("%s", engine.huge_pages.line())
        log.info("n_ctx=%d n_batch=%d n_ubatch=%d threads=%d threads_batch=%d cpus=%s "
                 "reproducible=%s chat_template=%s", engine.n_ctx, model_config.n_batch,
                 engine.n_ubatch, engine.n_threads, engine.n_threads_batch, state.cpus,
                 model_config.reproducible,
                 state.chat_template.label if state.chat_template else None)
        log.info("llama.cpp system info: %s", engine.system_info.strip())
        log.info("%s; adaptive threads %s", openmp.describe(os.environ, openmp.mapped_paths()),
                 "on" if engine.threads.adaptive else "off")
        ratios = engine.step_cost_ratios()
        if ratios is not None:
            # Only a first start on this machine measures them (engine/costsfile.py).
            engine.save_step_costs()
            log.info("drafts judged by step costs %s (in one-row steps, by rows; %s)",
                     " ".join(f"{rows}:{ratio:.2f}" for rows, ratio in ratios.items()),
                     _costs_source(engine))
        state.ready.set()
        state.load_ended.set()
        # The one line a person or a script waits for; systemd gets the same as STATUS.
        also = "".join(f"; {frontend.describe()}" for frontend in self._frontends)
        log.info("ready: serving %s on %s with %d slots%s", info.name, self.socket_path,
                 engine.slots, also)
        # Whoever is told "ready" can read every startup line (the listener thread may lag).
        logs.wait_written()
        systemd.notify(f"READY=1\nSTATUS=serving {info.name} on {self.socket_path}{also}")
        return True

    def _decode_stopped(self, future: concurrent.futures.Future[None]) -> None:
        """The decode thread ended. After `close` that is the shutdown; otherwise it
        died, and nothing accepted would ever be answered: every request gets an
        error now, `health` says "draining", and the daemon exits non-zero so that
        its supervisor starts it again."""
        error = future.exception()
        if error is None and self._stop.is_set():
            return
        self.failed = self.state.draining = True
        log.critical("the decode thread died; answering every request with an error and "
                     "exiting with status %d to be restarted", EXIT_DECODE_FAILED,
                     exc_info=error)
        systemd.notify("STATUS=the decode thread died; exiting")
        if self.state.scheduler is not None:
            self.state.scheduler.fail_all(protocol.INTERNAL, "the daemon's decode thread "
                                          "failed (see its log); the daemon exits to be "
                                          "restarted")
        self._stop.set()

    def request_stop(self, signum: int | None = None) -> None:
        self._stop_count += 1
        if self._stop_count == 1:
            log.info("received %s; draining", signal.Signals(signum).name if signum else "stop")
            self._stop.set()
        elif self.state.scheduler is not None:
            log.info("second stop signal: cancelling the running request now")
            self.state.scheduler.cancel_running()

    async def _shutdown(self) -> None:
        self.state.draining = True
        systemd.notify("STOPPING=1")
        if self._listener is not None:
            self._listener.close()
        for frontend in self._frontends:
            await frontend.stop_accepting()
        scheduler = self.state.scheduler
        if scheduler is not None:
            scheduler.reject_waiting(protocol.SHUTTING_DOWN, "the daemon is shutting down")
        # Connections with nothing running are answered and closed now; the others
        # close once their running request has finished.
        for connection in list(self.connections):
            if not connection.generating:
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
        for frontend in self._frontends:
            await frontend.close()
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
        connection = Connection(self.ops, reader, writer)
        self.state.stats.connections_total += 1
        try:
            rejection = self._admission_error(writer)
            if rejection is not None:
                self.state.stats.connections_rejected += 1
                code, message = rejection
                connection.reply_error(None, code, message)
                await connection.close_after_replies()
                return
            self.connections.add(connection)
            self.state.stats.connections_current = len(self.connections)
            await connection.serve()
        except asyncio.CancelledError:
            connection.drop("daemon stopping")
        except Exception:
            log.exception("connection handler failed")
            connection.drop("internal error")
        finally:
            self.connections.discard(connection)
            self.state.stats.connections_current = len(self.connections)
            self._connection_tasks.discard(task)

    def _admission_error(self, writer: asyncio.StreamWriter) -> tuple[str, str] | None:
        server_config = self.config.server
        if self.state.draining:
            return protocol.SHUTTING_DOWN, "the daemon is shutting down"
        restricted = access.restricted(server_config)
        if restricted or log.isEnabledFor(logging.DEBUG):
            sock = writer.get_extra_info("socket")
            creds = peer_credentials(sock)
            log.debug("connection from pid/uid/gid %s", creds)
            if restricted:
                if creds is None:
                    return protocol.FORBIDDEN, "cannot read the peer's credentials"
                _, uid, gid = creds
                why = access.refusal(server_config, uid, gid, lambda: peer_groups(sock))
                if why is not None:
                    return protocol.FORBIDDEN, why
        if len(self.connections) >= server_config.max_connections:
            return (protocol.TOO_MANY_CONNECTIONS,
                    f"server.max_connections ({server_config.max_connections}) already open")
        return None
