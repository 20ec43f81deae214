#!/usr/bin/env python3
"""Side-by-side figures for the daemon (through its socket) and llama-cpp-python in-process.

Measures, in one run on the same model, threads and prompt: load time, time to
ready, first-token time and greedy decode rate, as medians of --runs runs.
(The full benchmark, with the C-API ceiling and llama-bench, is scripts/bench.py.)

    .venv/bin/python scripts/compare.py [--model PATH] [--runs 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Jelaskan Rust dalam 1 kalimat"


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f}  ({min(values):.1f}-{max(values):.1f})"


def direct_run(model: str, threads: int, tokens: int) -> dict[str, float]:
    """llama-cpp-python's high-level Llama, in this process (fresh process per run)."""
    code = f"""
import json, time
t0 = time.perf_counter()
from llama_cpp import Llama
llm = Llama(model_path={model!r}, n_ctx=8192, n_batch=512, n_threads={threads},
            n_threads_batch={threads}, verbose=False)
t_loaded = time.perf_counter()
t_send = time.perf_counter()
stamps = []
for chunk in llm.create_completion({PROMPT!r}, max_tokens={tokens}, temperature=0.0,
                                   stream=True):
    stamps.append(time.perf_counter())
print(json.dumps({{"load_ms": (t_loaded - t0) * 1e3, "ready_ms": (t_loaded - t0) * 1e3,
                  "first_token_ms": (stamps[0] - t_send) * 1e3,
                  "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                  "tokens": len(stamps)}}))
"""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_ms"] = (time.perf_counter() - started) * 1e3
    return result


def daemon_run(model: str, threads: int, tokens: int) -> dict[str, float]:
    """The daemon as a client sees it: spawn, wait for READY=1, stream one request."""
    directory = Path(tempfile.mkdtemp(prefix="sfc", dir="/tmp"))
    sock_path, notify_path = directory / "d.sock", directory / "n"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(300)
    config = directory / "c.toml"
    config.write_text(f'[model]\npath = "{model}"\nn_ctx = 8192\n'
                      f"[runtime]\nn_threads = {threads}\nn_threads_batch = {threads}\n")
    env = dict(os.environ, NOTIFY_SOCKET=str(notify_path))
    started = time.perf_counter()
    with (directory / "log").open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "sfcore_daemon", "--config", str(config), "--socket",
             str(sock_path)], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        while notify.recv(4096) != b"READY=1":
            pass
        ready_ms = (time.perf_counter() - started) * 1e3
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(sock_path))
        reader = client.makefile("rb")
        request = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
        t_send = time.perf_counter()
        client.sendall(json.dumps(request).encode() + b"\n")
        stamps = []
        while True:
            line = json.loads(reader.readline())
            if line["type"] != "token":
                break
            stamps.append(time.perf_counter())
        assert line["type"] == "done", line
        client.close()
        log = (directory / "log").read_text()
        load_ms = float(log.split(" loaded in ")[1].split(" ms")[0]) if " loaded in " in log \
            else float("nan")
        return {"load_ms": load_ms, "ready_ms": ready_ms,
                "first_token_ms": (stamps[0] - t_send) * 1e3,
                "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                "daemon_first_token_ms": line["timings"]["first_token_ms"],
                "daemon_decode_tok_s": line["timings"]["decode_tok_s"],
                "tokens": line["usage"]["completion_tokens"]}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        notify.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF path (default: the embedded default model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from sfcore_daemon.models import resolve_model_path

    model = resolve_model_path(args.model or "")
    results: dict[str, list[dict[str, float]]] = {"direct": [], "daemon": []}
    for run in range(args.runs):
        for name, measure in (("direct", direct_run), ("daemon", daemon_run)):
            print(f"run {run + 1}/{args.runs}: {name} ...", file=sys.stderr, flush=True)
            results[name].append(measure(model, args.threads, args.tokens))
    figures = [("load_ms", "model load (ms)"), ("ready_ms", "start to ready (ms)"),
               ("first_token_ms", "first token, client-side (ms)"),
               ("decode_tok_s", "decode, client-side (tok/s)")]
    print(f"\nmodel {model}, {args.threads} threads, greedy, {args.tokens} tokens, "
          f"median (min-max) of {args.runs} runs")
    print(f"{'figure':34} {'llama-cpp-python Llama':>26} {'sfcore daemon (socket)':>26}"
          f" {'daemon/direct':>14}")
    for key, label in figures:
        direct = [r[key] for r in results["direct"]]
        daemon = [r[key] for r in results["daemon"]]
        ratio = statistics.median(daemon) / statistics.median(direct)
        print(f"{label:34} {median_range(direct):>26} {median_range(daemon):>26} {ratio:14.3f}")
    for key, label in (("daemon_first_token_ms", "daemon-reported first token (ms)"),
                       ("daemon_decode_tok_s", "daemon-reported decode (tok/s)")):
        print(f"{label:34} {'':>26} {median_range([r[key] for r in results['daemon']]):>26}")


if __name__ == "__main__":
    main()
