"""`sfcore-daemon`: parse flags, apply them over the config, pin CPUs, run the server.

A user's mistake (bad config, missing model, busy socket) ends here as one line
on stderr and a non-zero exit, never as a traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Coroutine, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from sfcore_daemon import __version__
from sfcore_daemon.config import Config, ConfigError, apply_overrides, load_config
from sfcore_daemon.system import openmp

if TYPE_CHECKING:
    from sfcore_daemon.httpd.api import HttpApi
    from sfcore_daemon.system.socketfile import ListeningSocket

log = logging.getLogger("sfcore_daemon")

EXIT_USAGE = 2
EXIT_STARTUP = 1


class _StopSignal(BaseException):
    """SIGINT or SIGTERM before the event loop takes the signals over."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _StopSignal(signum)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sfcore-daemon",
        description="Local LLM inference daemon: one GGUF model, NDJSON over a Unix socket.",
    )
    parser.add_argument("--config", metavar="PATH",
                        help="config file (default: ./server_config.toml if present, "
                             "else built-in defaults)")
    parser.add_argument("--socket", metavar="PATH", help="override [server] socket_path")
    parser.add_argument("--model", metavar="PATH", help="override [model] path (a GGUF file)")
    parser.add_argument("--threads", metavar="N", type=int,
                        help="override [runtime] n_threads (decode threads)")
    parser.add_argument("--openai", metavar="ADDRESS",
                        help="override [openai] listen: serve the OpenAI-compatible HTTP API "
                             "on HOST:PORT (loopback) or unix:/path")
    parser.add_argument("--self-check", action="store_true",
                        help="load the model, decode one multi-token batch and exit: 0 when "
                             "this llama.cpp build runs here")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def set_library_defaults(environ: MutableMapping[str, str]) -> None:
    """Settings read from the environment by llama.cpp and the BLAS it links; each is a
    default that the user's own environment overrides. Set before llama.cpp loads."""
    environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # cuBLAS's f16 Hopper kernel aborts on multi-row steps replayed from a CUDA graph; f32
    # avoids it (docs/gpu.md, "The crash under concurrent speculation"). Others ignore it.
    environ.setdefault("GGML_CUDA_CUBLAS_COMPUTE_TYPE", "f32")
    # libgomp's spin at ggml's per-node barriers: short, so that a decode thread whose
    # partner another process preempted sleeps instead of spinning for milliseconds.
    openmp.set_spin_default(environ)


def resolve_config(args: argparse.Namespace) -> Config:
    config = load_config(args.config)
    # Only flags the user gave: None means "not on the command line".
    return apply_overrides(
        config,
        server__socket_path=args.socket,
        model__path=args.model,
        runtime__n_threads=args.threads,
        openai__listen=args.openai,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # A fatal signal in native code (an illegal instruction in llama.cpp, the watchdog's
    # SIGABRT) writes the signal and every thread's Python stack to stderr: the journal.
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    set_library_defaults(os.environ)
    if argv[:1] == ["tune"]:
        from sfcore_daemon.tune.command import main as tune_main

        return tune_main(argv[1:])
    args = build_parser().parse_args(argv)
    # Until the event loop installs its own handlers, a stop signal unwinds start-up
    # (removing a half-assembled model, aborting the load) and ends with one line.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_stop)
    try:
        return _main(args)
    except _StopSignal as stop:
        name = signal.Signals(stop.signum).name
        print(f"sfcore-daemon: stopped by {name} during start-up", file=sys.stderr)
        return 128 + stop.signum


def _main(args: argparse.Namespace) -> int:
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"sfcore-daemon: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from sfcore_daemon.system import cpus

    try:
        # Before any thread exists (the log listener included): a thread inherits
        # its creator's CPU mask, and pinning the process later changes one thread only.
        pinned = cpus.pin(config.runtime.cpu_affinity)
    except cpus.CpuError as exc:
        print(f"sfcore-daemon: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    from sfcore_daemon.system.logs import setup_logging

    # The self-check prints its one line; only llama.cpp's warnings join it.
    listener = setup_logging("warning" if args.self_check else config.log.level)
    try:
        return _self_check(config, pinned) if args.self_check else _run(config, pinned)
    finally:
        listener.stop()


def _self_check(config: Config, pinned: list[int]) -> int:
    """What the daemon does before `ready`, alone: load, one batched decode, free."""
    from sfcore_daemon.llama import modelfile
    from sfcore_daemon.llama.logrouter import route_llama_logs
    from sfcore_daemon.llama.model import Model, ModelLoadError, llama_cpp_version
    from sfcore_daemon.llama.selfcheck import check_batched_decode
    from sfcore_daemon.system import cpus

    n_threads, n_threads_batch = cpus.derive_threads(
        pinned, config.runtime.n_threads, config.runtime.n_threads_batch)
    try:
        model_path = modelfile.resolve_model_path(config.model.path)
        route_llama_logs()
        model = Model.load(model_path, config.model, n_threads, n_threads_batch, slots=1)
        try:
            elapsed_ms = check_batched_decode(model)
        finally:
            model.close(timeout=10.0)
    except (modelfile.ModelSourceError, ModelLoadError) as exc:
        print(f"sfcore-daemon: self-check: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    print(f"self-check: ok: {model.info.name} decoded a batch in {elapsed_ms:.0f} ms with "
          f"llama.cpp {llama_cpp_version()} on {n_threads} threads")
    return 0


def _run(config: Config, pinned: list[int]) -> int:
    from sfcore_daemon.llama import modelfile
    from sfcore_daemon.system import cpus

    n_threads, n_threads_batch = cpus.derive_threads(
        pinned, config.runtime.n_threads, config.runtime.n_threads_batch)
    try:
        model_path = modelfile.resolve_model_path(config.model.path)
    except modelfile.ModelSourceError as exc:
        log.error("%s", exc)
        return EXIT_STARTUP

    from sfcore_daemon.system.socketfile import StartupError, open_listening_socket

    # Before the load starts: a busy or unusable path must end start-up before
    # llama.cpp reads the model, with nothing left running behind the error line.
    try:
        listening = open_listening_socket(config.server.resolved_socket_path(),
                                          config.server.socket_mode_bits)
    except StartupError as exc:
        log.error("%s", exc)
        return EXIT_STARTUP
    http: ListeningSocket | None = None
    try:
        address = config.openai.address
        if address is not None:
            from sfcore_daemon.httpd.listener import open_http_socket

            http = open_http_socket(address, config.server.socket_mode_bits)
        _check_descriptors(config, http is not None)
        return _serve(config, pinned, model_path, listening=listening, http=http,
                      n_threads=n_threads, n_threads_batch=n_threads_batch)
    except StartupError as exc:
        log.error("%s", exc)
        return EXIT_STARTUP
    finally:
        if http is not None:
            http.sock.close()
            http.remove()
        listening.remove()


def _check_descriptors(config: Config, http: bool) -> None:
    from sfcore_daemon.system.fdlimit import ensure_descriptors

    # Each listener holds at most max_connections, and one more for the moment it takes
    # to refuse it (NDJSON) or to close an idle one for it (HTTP).
    limit = config.server.max_connections
    listeners = 2 if http else 1
    ensure_descriptors(listeners * (limit + 1), f"server.max_connections = {limit} on "
                       + ("each of the NDJSON and HTTP listeners" if http else "the socket"))


def _serve(config: Config, pinned: list[int], model_path: str, *,
           listening: ListeningSocket, http: ListeningSocket | None, n_threads: int,
           n_threads_batch: int) -> int:
    import msgspec

    from sfcore_daemon.engine.speculative import draft_settings
    from sfcore_daemon.engine.thread import Engine
    from sfcore_daemon.llama import invariant
    from sfcore_daemon.llama.gpu import gpu_layers
    from sfcore_daemon.llama.logrouter import route_llama_logs
    from sfcore_daemon.llama.model import ModelLoadError
    from sfcore_daemon.llama.stepcost import costs_folder
    from sfcore_daemon.store.promptstore import prompt_store
    from sfcore_daemon.system.socketfile import StartupError

    # Before llama.cpp's first call (gpu_layers below starts its backends).
    invariant.enable(config.model.reproducible)
    route_llama_logs()
    # "auto" becomes the number llama.cpp is given, so that `info` and the prompt
    # store's fingerprint (the same 0 a CPU build always had) show what was used.
    config = msgspec.structs.replace(config, model=msgspec.structs.replace(
        config.model, n_gpu_layers=gpu_layers(config.model.n_gpu_layers)))
    try:
        engine = Engine(model_path, config.model, n_threads, n_threads_batch,
                        slots=config.server.slots,
                        prefill_per_step=config.server.prefill_per_step,
                        drafts=draft_settings(config.speculative),
                        store=prompt_store(config.cache), cpus=len(pinned),
                        adaptive_threads=config.runtime.adaptive_threads,
                        step_costs_dir=costs_folder(config.cache))
    except ModelLoadError as exc:
        log.error("%s", exc)
        return EXIT_STARTUP
    # llama.cpp reads the model on the decode thread (the GIL is released in C)
    # while this thread imports the server and sets up the event loop.
    engine.start()
    try:
        from sfcore_daemon.core.server import Frontend, Server
        from sfcore_daemon.ndjson.listener import NdjsonListener

        frontends: list[Frontend] = [NdjsonListener(config, listening)]
        if http is not None:
            from sfcore_daemon.httpd.listener import HttpListener

            frontends.append(HttpListener(config, http, _http_apis()))
        server = Server(config, engine, pinned, frontends)
        return _run_event_loop(server.run())
    except (StartupError, ModelLoadError) as exc:
        log.error("%s", exc)
        return EXIT_STARTUP
    finally:
        # Shutdown order: the model is freed first, then the socket file goes.
        engine.close()


def _http_apis() -> list[HttpApi]:
    """The APIs the HTTP listener serves, each a front end of its own."""
    from sfcore_daemon.anthropic.api import MessagesApi
    from sfcore_daemon.ollama.api import OllamaApi
    from sfcore_daemon.openai.api import OpenAIApi
    from sfcore_daemon.responses.api import ResponsesApi

    return [OpenAIApi(), ResponsesApi(), MessagesApi(), OllamaApi()]


def _run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(main)
    result: int = uvloop.run(main)
    return result


if __name__ == "__main__":
    sys.exit(main())
