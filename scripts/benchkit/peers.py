"""The one peer launcher: llama.cpp's own programs and llama-cpp-python, on the same GGUF
file, threads and batch sizes as the daemon. `params["model"]` is the file every peer loads
(the daemon's `--model`): llama-server (`-m`), llama-batched-bench, llama-bench, and
llama-cpp-python's high-level `Llama`."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchkit.common import TIMEOUT_S, run_together

GREEDY_SERVER = {"temperature": 0.0, "top_k": 1}
BATCHED_PP = 32  # llama-batched-bench -npp
BATCHED_CLIENTS = (1, 2, 4, 8)  # llama-batched-bench -npl


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class LlamaServer:
    """llama-server on a loopback port with `-np slots`. Its KV: "split" (llama-server's
    default with an explicit -np): `-c` = n_ctx x slots, divided among the slots, so each
    request may use n_ctx cells as in the daemon; "unified": `-kvu -c n_ctx`, one pool of
    n_ctx cells shared by the slots, the daemon's own layout; "default": llama-server's own
    settings (slots, context, batch sizes), only the model, address and threads given."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, logfile: Path) -> None:
        self.process, self.port, self.logfile = process, port, logfile

    @staticmethod
    def command(binary: str, params: dict[str, Any], slots: int, port: int,
                extra: tuple[str, ...] | list[str] = ()) -> list[str]:
        if params.get("llama_server_kv") == "default":
            return [binary, "-m", params["model"], "--host", "127.0.0.1", "--port", str(port),
                    "-t", str(params["n_threads"]), "-tb", str(params["n_threads_batch"]),
                    *extra]
        unified = params.get("llama_server_kv") == "unified"
        kv = ["-kvu", "-c", str(params["n_ctx"])] if unified else [
            "-c", str(params["n_ctx"] * slots)]
        return [binary, "-m", params["model"], "--host", "127.0.0.1", "--port", str(port),
                "-np", str(slots), *kv,
                "-t", str(params["n_threads"]), "-tb", str(params["n_threads_batch"]),
                "-b", "512", "-ub", "512", "--swa-full", *extra]

    @classmethod
    def start(cls, binary: str, params: dict[str, Any], slots: int,
              extra: tuple[str, ...] | list[str] = ()) -> LlamaServer:
        port = free_port()
        logfile = Path(tempfile.mkstemp(prefix="sfbench-llama-server-", suffix=".log")[1])
        with logfile.open("wb") as out:
            process = subprocess.Popen(cls.command(binary, params, slots, port, extra),
                                       stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=subprocess.STDOUT)
        server = cls(process, port, logfile)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            if process.poll() is not None:
                tail = logfile.read_text(errors="replace")[-2000:]
                logfile.unlink(missing_ok=True)
                raise RuntimeError(f"llama-server exited with {process.returncode}:\n{tail}")
            try:
                status, _ = server.call("GET", "/health", None, timeout=5.0)
                if status == 200:
                    return server
            except OSError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError("llama-server did not become ready")
            time.sleep(0.1)

    def call(self, method: str, path: str, body: dict[str, Any] | None,
             timeout: float = TIMEOUT_S) -> tuple[int, dict[str, Any]]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body)
            connection.request(method, path, payload, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        return response.status, json.loads(data) if data else {}

    def completion(self, prompt: str, tokens: int) -> dict[str, Any]:
        status, reply = self.call("POST", "/completion", {
            "prompt": prompt, "n_predict": tokens, "stream": False, **GREEDY_SERVER})
        if status != 200:
            raise RuntimeError(f"llama-server answered {status}: {reply}")
        return reply

    def aggregate(self, prompts: list[str], tokens: int) -> float:
        """Tokens/s of one request per prompt, sent at once from as many threads and
        connections (connected before the clock starts)."""
        clients = len(prompts)
        connections = [http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
                       for _ in range(clients)]
        for connection in connections:
            connection.connect()

        def client(index: int) -> tuple[int, float]:
            connection = connections[index]
            body = json.dumps({"prompt": prompts[index], "n_predict": tokens,
                               "stream": False, **GREEDY_SERVER})
            try:
                connection.request("POST", "/completion", body,
                                   {"Content-Type": "application/json"})
                reply = json.loads(connection.getresponse().read())
                return int(reply["tokens_predicted"]), time.perf_counter()
            finally:
                connection.close()

        runs, started = run_together(clients, client)
        return sum(n for n, _ in runs) / (max(t for _, t in runs) - started)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        self.logfile.unlink(missing_ok=True)


# --- llama-batched-bench ------------------------------------------------------------------


def batched_bench_command(binary: str, params: dict[str, Any]) -> list[str]:
    pl = max(BATCHED_CLIENTS)
    return [binary, "-m", params["model"], "-npp", str(BATCHED_PP),
            "-ntg", str(params["tokens"]), "-npl", ",".join(map(str, BATCHED_CLIENTS)),
            "-t", str(params["n_threads"]), "-tb", str(params["n_threads_batch"]),
            "-c", str(max(params["n_ctx"], pl * (BATCHED_PP + params["tokens"]))),
            "--output-format", "jsonl"]


def parse_batched_bench(text: str) -> dict[int, float]:
    """S_TG by batch size, from jsonl lines or from the markdown table."""
    result: dict[int, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("{") and "speed_tg" in line:
            row = json.loads(line)
            result[int(row["pl"])] = float(row["speed_tg"])
        elif line.startswith("|") and not line.startswith("|-"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == 10 and cells[2].isdigit():  # PP TG B N_KV ... S_TG ...
                result[int(cells[2])] = float(cells[7])
    return result


def run_batched_bench(binary: str, params: dict[str, Any]) -> dict[int, float]:
    out = subprocess.run(batched_bench_command(binary, params), capture_output=True, text=True,
                         check=False, timeout=900)
    result = parse_batched_bench(out.stdout + "\n" + out.stderr)
    if out.returncode != 0 or not result:
        raise RuntimeError(f"llama-batched-bench failed ({out.returncode}): "
                           f"{(out.stderr or out.stdout)[-2000:]}")
    return result


# --- llama-bench ---


def run_llama_bench(binary: str, params: dict[str, Any], prefill_tokens: int
                    ) -> dict[str, float]:
    command = [binary, "-m", params["model"], "-t", str(params["n_threads"]),
               "-p", str(prefill_tokens), "-n", str(params["tokens"]), "-r", "1",
               "-o", "json"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, float] = {}
    for row in json.loads(out.stdout):
        key = "prefill_tok_s" if row.get("n_prompt", 0) > 0 else "decode_tok_s"
        result[key] = float(row["avg_ts"])
    return result


# --- llama-cpp-python's high-level API ---


PEER_CODE = """
import json, sys, time
params = json.loads(sys.argv[1])
from llama_cpp import Llama
llm = Llama(model_path=params["model"], n_ctx=params["n_ctx"], n_batch=512,
            n_threads=params["n_threads"], n_threads_batch=params["n_threads_batch"],
            flash_attn=True, verbose=False)
print("ready", flush=True)
stamps = []
started = time.perf_counter()
for _ in llm.create_completion(params["prompt"], max_tokens=params["tokens"], temperature=0.0,
                               stream=True):
    stamps.append(time.perf_counter())
print(json.dumps({"first_token_ms": (stamps[0] - started) * 1e3,
                  "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}))
"""


def run_peer(params: dict[str, Any], prompt: str) -> dict[str, Any]:
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", PEER_CODE, json.dumps({**params, "prompt": prompt})],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    try:
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError("llama-cpp-python's Llama failed to start")
        ready_ms = (time.perf_counter() - started) * 1e3
        result: dict[str, Any] = json.loads(process.stdout.readline())
        process.wait(TIMEOUT_S)
    finally:
        process.kill()
    result["ready_ms"] = ready_ms
    return result


def peer_paths(**paths: str | None) -> list[str]:
    """Problems with the peers' paths (given by name: llama_server=...), found before
    anything runs."""
    return [f"{name.replace('_', '-')} {path} is not an executable file"
            for name, path in paths.items()
            if path and not (os.path.isfile(path) and os.access(path, os.X_OK))]
