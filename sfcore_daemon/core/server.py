"""The daemon's lifetime: front ends started, the model awaited, an ordered shutdown.

`Server` owns the engine and the front ends (each owns its listener and connections):
on a stop signal every front end stops accepting, the queue is refused, the running
requests drain with a timeout, the rest are cancelled, the front ends close, and only
then is the model freed. What the front ends read of the daemon is its `ServerState`.
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
from sfcore_daemon.core import errors
from sfcore_daemon.core.chat import ChatTemplateError, TemplateBudgetError, resolve_template
from sfcore_daemon.core.costwatch import CostWatch
from sfcore_daemon.core.scheduler import Scheduler
from sfcore_daemon.core.state import ServerState
from sfcore_daemon.core.threads import ThreadMonitor
from sfcore_daemon.engine.thread import Engine
from sfcore_daemon.llama.model import LoadAborted
from sfcore_daemon.llama.stepcost import BUSY_SHARE
from sfcore_daemon.system import logs, openmp, systemd
from sfcore_daemon.system.socketfile import StartupError

log = logging.getLogger(__name__)

_CLOSE_GRACE_S = 5.0
# Exit status after the decode thread died (EX_SOFTWARE): not 0, so Restart=on-failure
# restarts the daemon, and not 2, the configuration error the unit does not restart.
EXIT_DECODE_FAILED = 70


class Frontend(Protocol):
    """A listener that translates its wire format into the core's requests (the NDJSON
    socket, the HTTP APIs), given to the server from above: started with the server,
    stopped in its shutdown order."""

    def describe(self) -> str:
        """Where it serves, for the ready line."""
        ...

    async def start(self, state: ServerState) -> None:
        """Accept connections (the model may still be loading)."""
        ...

    async def stop_accepting(self) -> None:
        """The shutdown's first step: no new connection; idle ones are closed."""
        ...

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
    """The daemon's lifetime: its front ends, the model's load, an ordered shutdown."""

    def __init__(self, config: Config, engine: Engine, cpus: list[int],
                 frontends: Sequence[Frontend]) -> None:
        """`engine` has been started (it may still be loading); the server closes it.
        The first front end is the one the ready line names (the NDJSON socket)."""
        self.config = config
        self._frontends = tuple(frontends)
        # Started, maybe still loading; `state.engine` once loaded.
        self._engine = engine
        self.state = ServerState(config, cpus)
        self._stop = asyncio.Event()
        self._stop_count = 0
        self._watchdog: asyncio.Task[None] | None = None
        self._thread_monitor: asyncio.Task[None] | None = None
        self._cost_watch: asyncio.Task[None] | None = None
        # Set when the decode thread died while serving: the daemon answers everything
        # with an error and exits with EXIT_DECODE_FAILED.
        self.failed = False

    # --- lifecycle ---

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop, signum)
        try:
            self._start_watchdog()
            for frontend in self._frontends:
                await frontend.start(self.state)
            log.info("listening on %s; loading the model", self._frontends[0].describe())
            systemd.notify("STATUS=loading the model")
            if await self._load() and not self._stop.is_set():
                await self._stop.wait()
            await self._shutdown()
        finally:
            for task in (self._watchdog, self._thread_monitor, self._cost_watch):
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
        drift = engine.cost_drift
        if drift is not None:
            self._cost_watch = asyncio.ensure_future(
                CostWatch(drift, state.scheduler, engine.discard_step_costs).run())
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
        log.info("%s", engine.loaded_model().weights.line())
        log.info("%s", engine.huge_pages.line())
        log.info("%s", engine.context_size.line())
        log.info("n_ctx=%d n_batch=%d n_ubatch=%d threads=%d threads_batch=%d cpus=%s "
                 "reproducible=%s chat_template=%s", engine.n_ctx, model_config.n_batch,
                 engine.n_ubatch, engine.n_threads, engine.n_threads_batch, state.cpus,
                 model_config.reproducible,
                 state.chat_template.label if state.chat_template else None)
        log.info("llama.cpp system info: %s", engine.system_info.strip())
        log.info("%s; adaptive threads %s", openmp.describe(os.environ, openmp.mapped_paths()),
                 "on" if engine.threads.adaptive else "off")
        # Kept for later starts where this one measured it (engine/attnchoice.py).
        engine.attention.save()
        ratios = engine.step_cost_ratios()
        share = engine.prefill_share
        if ratios is not None or share is not None:
            # Only a first start on this machine measures them (engine/costsfile.py).
            engine.save_step_costs()
        if ratios is not None:
            log.info("drafts judged by step costs %s (in one-row steps, by rows; %s)",
                     " ".join(f"{rows}:{ratio:.2f}" for rows, ratio in ratios.items()),
                     _costs_source(engine))
        if share is not None:
            beside = (f"{share.rows(1, 0, 0)}, {share.rows(1, 0, engine.n_ctx // 2)} at depth "
                      f"{engine.n_ctx // 2}" if self.config.server.prefill_per_step == 0
                      else f"{self.config.server.prefill_per_step} (prefill_per_step)")
            log.info("prompt rows a step beside one stream: %s; of eight 32-token short rests: "
                     "%d (by the measured step costs; %s)", beside,
                     share.short_rows(0, 0, 0, 8 * 32), _costs_source(engine))
        state.ready.set()
        state.load_ended.set()
        # The one line a person or a script waits for; systemd gets the same as STATUS.
        where = self._frontends[0].describe()
        also = "".join(f"; {frontend.describe()}" for frontend in self._frontends[1:])
        log.info("ready: serving %s on %s with %d slots%s", info.name, where, engine.slots, also)
        # Whoever is told "ready" can read every startup line (the listener thread may lag).
        logs.wait_written()
        systemd.notify(f"READY=1\nSTATUS=serving {info.name} on {where}{also}")
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
            self.state.scheduler.fail_all(errors.INTERNAL, "the daemon's decode thread "
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
        for frontend in self._frontends:
            await frontend.stop_accepting()
        scheduler = self.state.scheduler
        if scheduler is not None:
            scheduler.reject_waiting(errors.SHUTTING_DOWN, "the daemon is shutting down")
        if scheduler is not None:
            try:
                await asyncio.wait_for(scheduler.wait_idle(), self.config.server.drain_timeout_s)
            except TimeoutError:
                log.warning("drain timeout (%.1f s) reached; cancelling the running request",
                            self.config.server.drain_timeout_s)
                scheduler.cancel_running()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(scheduler.wait_idle(), _CLOSE_GRACE_S)
        for frontend in self._frontends:
            await frontend.close()
        # Only now: a request still being tokenized holds the vocabulary, and close()
        # waits for it before freeing the model.
        if not await asyncio.to_thread(self._engine.close):
            log.error("the decode thread did not stop; leaving the model to the OS")
        log.info("stopped")
