"""The prompt-cache section of scripts/bench.py (`--only cache`): the daemon's persistent
prompt cache (`[cache]`: KV states of long prefixes kept in RAM and on disk, restored into
a slot instead of evaluated) against cold evaluation and against llama-server's host-RAM
prompt cache (`--cache-ram`), in the same run.

1. Restore (each of --runs runs on fresh daemons and a fresh temp cache dir): a daemon
   with `[server] slots = 1` and a ~2000-token prefix, each request the prefix plus a
   short question, 16 greedy tokens, `speculative: false`. First token, as the client sees
   it (from the send to the first token line), of the prefix

   (a) cold: `cache_prompt: false` (the whole prompt evaluated, nothing restored or saved);
   (b) warm in its slot: sent again with another question on the same daemon;
   (c) restored from RAM: a different prompt overwrote the only slot in between;
   (d) restored from disk: the daemon stopped (SIGTERM) and a new one started on the same
       `[cache] dir`.

   Each as ms and as the paired ratio to (a), with `timings.cache_source` and
   `usage.cached_tokens`; and whether the restored greedy answers are the bytes of the
   cold answers to the same requests (the disk one also against the same request sent
   cold to the restarted daemon after it). Every daemon first evaluates one unmeasured cold
   ~500-token prompt (llama.cpp's first-touch page faults), so (a) and (d) pay none.
2. Churn (once per invocation): 8 slots, 12 clients, 12 system prompts of ~960 tokens;
   in round r client c sends system prompt (c + r) mod 12 plus a question of its own
   (so the 12 requests of a round are 12 different prompts, more than the slots hold),
   8 greedy tokens. All 12 send at once, each round waits for all. First token as the
   client sees it (queueing included), mean and median over the measured rounds, on: the
   daemon with its cache (default `[cache]`, a fresh dir), the daemon with every request
   `cache_prompt: false`, and llama-server (`--llama-server PATH`) with `-np 8` and
   `--cache-ram`, streaming `/completion` with `cache_prompt: true`. Round 0 fills the
   caches of the two caching sides and is not measured (reported apart).
3. After the churn: the caching daemon's RSS and the bytes in its cache dir against the
   `[cache] disk_mb` budget.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from benchkit.common import TIMEOUT_S, decode_reply, filler_text, log, run_together
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream, fit_prompt, log_tail
from benchkit.peers import LlamaServer, peer_paths
from benchkit.table import cell, paired_ratio, summary

HELP = "prompt cache: restores (slot, RAM, disk) and churn, llama-server --cache-ram beside"

PREFIX_TOKENS = 2000
ANSWER_TOKENS = 16
QUESTIONS = {  # one per request of a restore run: no request is a repeat of another
    "cold": "\n\nQuestion: which word comes first in the text above?\nAnswer:",
    "seed": "\n\nQuestion: is the word river in the text above?\nAnswer:",
    "slot": "\n\nQuestion: how many sentences does the text above have?\nAnswer:",
    "ram": "\n\nQuestion: what is the last word of the text above?\nAnswer:",
    "disk": "\n\nQuestion: summarise the text above in one line.\nAnswer:",
}
WARM_UP_WORDS = 400  # ~500 tokens, cold: pays llama.cpp's first-touch costs unmeasured
EVICT_WORDS = 250  # a prompt that overwrites the only slot (it shares nothing but BOS)
CHURN_SLOTS = 8
CHURN_CLIENTS = 12
CHURN_PROMPTS = 12
CHURN_PROMPT_TOKENS = 960  # 8 x (960 + question + 8) fits the 8192-cell pool at once
CHURN_TOKENS = 8
DISK_MB = 2048  # [cache] disk_mb (MiB), written explicitly (the default)
LLAMA_SERVER_CACHE_RAM_MB = 2048  # llama-server --cache-ram (MiB)
REQUEST = {"temperature": 0.0, "speculative": False, "stream": True}

Runner = Callable[[Coroutine[Any, Any, Any]], Any]


# --- the daemon -----------------------------------------------------------------------------


async def start_daemon(params: dict[str, Any], cache_dir: Path, log_path: Path,
                       slots: int | None) -> Daemon:
    """benchkit's Daemon on `cache_dir`, logging at level info into `log_path`."""
    return await Daemon.start(
        {**params, "slots": slots}, log_path, log_level="info", append=True,
        config=f"[cache]\ndir = {json.dumps(str(cache_dir))}\ndisk_mb = {DISK_MB}\n")


async def stop_daemon(daemon: Daemon) -> None:
    """SIGTERM and wait (Daemon.stop: killed if that fails, so nothing is left running)."""
    await daemon.stop()


@contextlib.asynccontextmanager
async def running_daemon(params: dict[str, Any], cache_dir: Path, log_path: Path,
                         slots: int) -> AsyncIterator[Daemon]:
    daemon = await start_daemon(params, cache_dir, log_path, slots)
    try:
        yield daemon
    finally:
        await stop_daemon(daemon)


@contextlib.contextmanager
def daemon_files(cache_dir: Path, log_path: Path) -> Iterator[None]:
    """Shows the tail of the daemons' log if the body fails; removes their files after."""
    try:
        yield
    except BaseException:
        log(f"  daemon log (tail): {log_tail(log_path)}")
        raise
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        log_path.unlink(missing_ok=True)


def log_problems(path: Path) -> list[str]:
    """The prompt cache's lines, the ERROR lines and the daemon's own WARNING lines (not
    llama.cpp's, which warns about the model at every start) in a daemon's log."""
    if not path.exists():
        return []
    return [line for line in path.read_text(errors="replace").splitlines()
            if "prompt cache" in line or "Traceback" in line or " ERROR " in line
            or (" WARNING " in line and ".llama_cpp: " not in line)]


async def ask(stream: Stream, request: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: the first token as the client sees it, the answer's text and
    what the done line says about the cache."""
    started = time.perf_counter()
    stream.writer.write(json.dumps(request).encode() + b"\n")
    first = 0.0
    parts: list[str] = []
    async with asyncio.timeout(TIMEOUT_S):
        while True:
            line = await stream.reader.readline()
            if not line:
                raise RuntimeError("the daemon closed the connection")
            now = time.perf_counter()
            reply = decode_reply(line)
            if reply["type"] == "token":
                first = first or now
                parts.append(reply["text"])
            elif reply["type"] == "done":
                first = first or now
                break
            else:
                raise RuntimeError(f"daemon answered {reply}")
    usage, timings = reply["usage"], reply["timings"]
    return {"first_token_ms": (first - started) * 1e3,
            "daemon_first_token_ms": timings.get("first_token_ms", float("nan")),
            "cache_source": timings.get("cache_source", "(missing)"),
            "cached_tokens": usage.get("cached_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "text": "".join(parts) + reply.get("text", "")}


async def op(stream: Stream, name: str) -> dict[str, Any]:
    stream.writer.write(json.dumps({"op": name}).encode() + b"\n")
    line = await asyncio.wait_for(stream.reader.readline(), TIMEOUT_S)
    return decode_reply(line)


def dir_usage(path: Path) -> dict[str, int]:
    """Files and bytes under path (apparent size and allocated blocks)."""
    files = size = blocks = 0
    if path.exists():
        for entry in path.rglob("*"):
            if entry.is_file():
                status = entry.stat()
                files += 1
                size += status.st_size
                blocks += status.st_blocks * 512
    return {"files": files, "bytes": size, "allocated_bytes": blocks}


def rss_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM in MB (10^6 bytes)."""
    result = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM"):
            result[key] = int(line.split()[1]) * 1024 / 1e6
    return {"rss_mb": result.get("VmRSS", float("nan")),
            "peak_rss_mb": result.get("VmHWM", float("nan"))}


# --- 1. restore: cold, slot, RAM, disk --------------------------------------------------------


async def restore_run(params: dict[str, Any], workdir: Path, index: int,
                      prefix: str | None) -> dict[str, Any]:
    """One run of section 1 on a fresh cache dir; `prefix` None: fitted here (run 0)."""
    cache_dir = workdir / f"restore-{index}"
    log_path = workdir / f"restore-{index}.log"
    request = {**REQUEST, "max_tokens": ANSWER_TOKENS}
    warm_up = {**request, "prompt": filler_text(WARM_UP_WORDS, seed=900 + index),
               "max_tokens": 1, "cache_prompt": False}
    result: dict[str, Any] = {}
    with daemon_files(cache_dir, log_path):
        async with running_daemon(params, cache_dir, log_path, slots=1) as daemon:
            stream = await Stream.open(daemon.socket_path)
            try:
                if prefix is None:
                    prefix = await fit_prompt(daemon.socket_path, PREFIX_TOKENS, seed=7)
                result["prefix"] = prefix
                await ask(stream, warm_up)
                cold = {name: await ask(stream, {**request, "prompt": prefix + QUESTIONS[name],
                                                 "cache_prompt": False})
                        for name in ("ram", "disk")}
                # A different prompt first: the seed request must evaluate the prefix
                # (>= min_tokens) even if the cold requests left their cells in the slot.
                await ask(stream, {**request, "prompt": filler_text(EVICT_WORDS, 800),
                                   "max_tokens": 1})
                seed = await ask(stream, {**request, "prompt": prefix + QUESTIONS["seed"]})
                warm = await ask(stream, {**request, "prompt": prefix + QUESTIONS["slot"]})
                await ask(stream, {**request, "prompt": filler_text(EVICT_WORDS, 801),
                                   "max_tokens": 1})
                ram = await ask(stream, {**request, "prompt": prefix + QUESTIONS["ram"]})
                result["stats_first_daemon"] = (await op(stream, "stats")).get("cache")
            finally:
                await stream.close()
        result["disk_at_restart"] = dir_usage(cache_dir)
        async with running_daemon(params, cache_dir, log_path, slots=1) as daemon:
            stream = await Stream.open(daemon.socket_path)
            try:
                await ask(stream, warm_up)
                disk = await ask(stream, {**request, "prompt": prefix + QUESTIONS["disk"]})
                # The same request cold on this daemon too: tells a restore that changes
                # the bytes from a cold answer that differs between the two processes.
                cold_again = await ask(stream, {**request, "cache_prompt": False,
                                                "prompt": prefix + QUESTIONS["disk"]})
                result["stats_second_daemon"] = (await op(stream, "stats")).get("cache")
            finally:
                await stream.close()
        result["log_problems"] = log_problems(log_path)
    rows = {"cold": cold["ram"], "cold_2": cold["disk"], "seed": seed, "slot": warm,
            "ram": ram, "disk": disk}
    for name, row in rows.items():
        result[f"{name}_ms"] = row["first_token_ms"]
        result[f"{name}_daemon_ms"] = row["daemon_first_token_ms"]
        result[f"{name}_source"] = row["cache_source"]
        result[f"{name}_cached_tokens"] = row["cached_tokens"]
    result["prompt_tokens"] = cold["ram"]["prompt_tokens"]
    # The cold figure: the mean of the run's two cold requests (same prefix, same length).
    result["cold_mean_ms"] = (cold["ram"]["first_token_ms"] + cold["disk"]["first_token_ms"]) / 2
    result["cold_mean_daemon_ms"] = (cold["ram"]["daemon_first_token_ms"]
                                     + cold["disk"]["daemon_first_token_ms"]) / 2
    result["ram_same_answer"] = ram["text"] == cold["ram"]["text"]
    result["disk_same_answer"] = disk["text"] == cold["disk"]["text"]
    result["disk_same_as_second_cold"] = disk["text"] == cold_again["text"]
    result["colds_agree"] = cold_again["text"] == cold["disk"]["text"]
    result["answers"] = {"cold_ram": cold["ram"]["text"], "ram": ram["text"],
                         "cold_disk": cold["disk"]["text"], "disk": disk["text"],
                         "cold_disk_second_daemon": cold_again["text"]}
    return result


RESTORE_ROWS = [  # key, label
    ("cold_mean", "(a) cold (`cache_prompt: false`)"),
    ("slot", "(b) warm in its slot (same daemon, new question)"),
    ("ram", "(c) restored from RAM (the only slot overwritten in between)"),
    ("disk", "(d) restored from disk (daemon restarted on the same cache dir)"),
]


def print_restore(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    print(f"1. Restore: a {samples[0]['prompt_tokens']}-token prompt (~{PREFIX_TOKENS}-token "
          f"prefix + question), 1 slot, {ANSWER_TOKENS} greedy tokens, no speculation; first "
          "token from the client's send to the first token line")
    print()
    print("| first token | ms (client) | ms (daemon's timings.first_token_ms) | x cold "
          "(paired) | cache_source per run | cached_tokens per run |")
    print("|---|---|---|---|---|---|")
    for key, label in RESTORE_ROWS:
        base = key.removesuffix("_mean")
        client = summary([s[f"{key}_ms"] for s in samples])
        daemon = summary([s[f"{key}_daemon_ms"] for s in samples])
        ratio = paired_ratio(samples, f"{key}_ms", samples, "cold_mean_ms")
        sources = ", ".join(str(s[f"{base}_source"]) for s in samples)
        cached = ", ".join(str(s[f"{base}_cached_tokens"]) for s in samples)
        print(f"| {label} | {cell(client)} | {cell(daemon)} | {ratio:.3f} | {sources} | "
              f"{cached} |")
    print()
    ram_same = sum(s["ram_same_answer"] for s in samples)
    disk_same = sum(s["disk_same_answer"] for s in samples)
    runs = len(samples)
    print(f"Restored greedy answer = the cold answer to the same request: RAM "
          f"{'yes' if ram_same == runs else 'NO'} ({ram_same}/{runs} runs), disk "
          f"{'yes' if disk_same == runs else 'NO'} ({disk_same}/{runs} runs).")
    again = sum(s["disk_same_as_second_cold"] for s in samples)
    agree = sum(s["colds_agree"] for s in samples)
    print(f"The same request cold on the restarted daemon (after the restore): equals the "
          f"disk-restored answer in {again}/{runs} runs, the first daemon's cold answer in "
          f"{agree}/{runs}.")
    at_restart = samples[0]["disk_at_restart"]
    print(f"Cache dir when the second daemon started (run 1): {at_restart['files']} files, "
          f"{at_restart['bytes'] / 1e6:.1f} MB.")
    ratio = paired_ratio(samples, "disk_ms", samples, "cold_mean_ms")
    return [{"target": "disk-restored first token <= 0.05 x cold", "measured": ratio,
             "met": ratio <= 0.05},
            {"target": "disk-restored greedy answer = cold answer (share of runs)",
             "measured": disk_same / runs, "met": disk_same == runs}]


# --- 2. churn ----------------------------------------------------------------------------------


def churn_question(client: int, round_: int) -> str:
    return (f"\n\nQuestion {client * 100 + round_}: which word appears most often in the "
            "text above?\nAnswer:")


def churn_prompt(prompts: list[str], client: int, round_: int) -> str:
    return prompts[(client + round_) % len(prompts)] + churn_question(client, round_)


def churn_figures(requests: list[dict[str, Any]]) -> dict[str, Any]:
    measured = [r for r in requests if r["round"] > 0]
    first_round = [r["first_token_ms"] for r in requests if r["round"] == 0]
    values = [r["first_token_ms"] for r in measured]
    return {
        "mean_ms": statistics.fmean(values) if values else float("nan"),
        "median_ms": statistics.median(values) if values else float("nan"),
        "max_ms": max(values, default=float("nan")),
        "requests": len(values),
        "round_0_mean_ms": statistics.fmean(first_round) if first_round else float("nan"),
        "cached_share": (sum(r["cached_tokens"] for r in measured)
                         / max(1, sum(r["prompt_tokens"] for r in measured))),
        "sources": dict(Counter(str(r.get("cache_source")) for r in measured)),
    }


async def churn_daemon(params: dict[str, Any], workdir: Path, rounds: int, cold: bool,
                       prompts: list[str] | None) -> dict[str, Any]:
    """The churn on one daemon (8 slots, a fresh cache dir). `prompts` None: fitted here."""
    name = "cold" if cold else "cache"
    cache_dir, log_path = workdir / f"churn-{name}", workdir / f"churn-{name}.log"
    request = {**REQUEST, "max_tokens": CHURN_TOKENS, "cache_prompt": not cold}
    result: dict[str, Any] = {}
    requests: list[dict[str, Any]] = []
    with daemon_files(cache_dir, log_path):
        async with running_daemon(params, cache_dir, log_path, slots=CHURN_SLOTS) as daemon:
            if prompts is None:
                prompts = [await fit_prompt(daemon.socket_path, CHURN_PROMPT_TOKENS, seed=100 + i)
                           for i in range(CHURN_PROMPTS)]
            result["prompts"] = prompts
            streams = [await Stream.open(daemon.socket_path) for _ in range(CHURN_CLIENTS)]
            try:
                await ask(streams[0], {**REQUEST, "prompt": filler_text(WARM_UP_WORDS, 990),
                                       "max_tokens": 1, "cache_prompt": False})

                async def client(index: int, round_: int) -> None:
                    reply = await ask(streams[index], {
                        **request, "prompt": churn_prompt(prompts, index, round_)})
                    reply.pop("text")
                    requests.append({**reply, "client": index, "round": round_})

                # All-cold needs no round to fill a cache: it is measured from round 1 on.
                for round_ in range(1 if cold else 0, rounds + 1):
                    started = time.perf_counter()
                    await asyncio.gather(*(client(i, round_) for i in range(CHURN_CLIENTS)))
                    log(f"  daemon {name}, round {round_}/{rounds}: "
                        f"{time.perf_counter() - started:.1f} s, mean first token "
                        f"{statistics.fmean(r['first_token_ms'] for r in requests[-12:]):.0f}"
                        " ms")
                result["stats_cache"] = (await op(streams[0], "stats")).get("cache")
                result["config_cache"] = (await op(streams[0], "info")).get(
                    "config", {}).get("cache")
                result.update(rss_mb(daemon.process.pid))
            finally:
                for stream in streams:
                    await stream.close()
        result["disk"] = dir_usage(cache_dir)
        result["log_problems"] = log_problems(log_path)
    result["request_log"] = requests
    result.update(churn_figures(requests))
    return result


def server_request(port: int, prompt: str, tokens: int, cache: bool = True) -> dict[str, Any]:
    """A streamed /completion: the first token as the client sees it (the first `data:`
    event: llama-server sends its headers with the first token). A connection of its own,
    connected before the clock starts (a kept-alive one was closed under the client)."""
    body = json.dumps({"prompt": prompt, "n_predict": tokens, "stream": True,
                       "cache_prompt": cache, "temperature": 0.0, "top_k": 1})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        connection.connect()
        started = time.perf_counter()
        connection.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"llama-server answered {response.status}: {response.read()!r}")
        first = 0.0
        final: dict[str, Any] = {}
        while True:
            line = response.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            first = first or time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"llama-server answered {chunk}")
            if chunk.get("stop"):
                final = chunk
                break
    finally:
        connection.close()
    if not first:
        raise RuntimeError("llama-server sent no event")
    timings = final.get("timings", {})
    return {"first_token_ms": (first - started) * 1e3,
            "cached_tokens": int(timings.get("cache_n", 0)),
            "prompt_tokens": int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0)),
            "server_prompt_ms": float(timings.get("prompt_ms", float("nan"))),
            "cache_source": "-"}


def churn_server(binary: str, params: dict[str, Any], prompts: list[str],
                 rounds: int) -> dict[str, Any]:
    """The churn on llama-server -np 8 --cache-ram N, from threads (one connection each)."""
    server = LlamaServer.start(binary, params, CHURN_SLOTS,
                               ["--cache-ram", str(LLAMA_SERVER_CACHE_RAM_MB)])
    requests: list[dict[str, Any]] = []
    try:
        server_request(server.port, filler_text(WARM_UP_WORDS, 990), 1, cache=False)
        for round_ in range(rounds + 1):
            def client(index: int, round_: int = round_) -> dict[str, Any]:
                return server_request(
                    server.port, churn_prompt(prompts, index, round_), CHURN_TOKENS)

            results, started = run_together(CHURN_CLIENTS, client)
            for index, result in enumerate(results):
                requests.append({**result, "client": index, "round": round_})
            log(f"  llama-server, round {round_}/{rounds}: {time.perf_counter() - started:.1f}"
                f" s, mean first token "
                f"{statistics.fmean(r['first_token_ms'] for r in requests[-12:]):.0f} ms")
    finally:
        server.stop()
    return {"request_log": requests, "kv": params.get("llama_server_kv", "split"),
            **churn_figures(requests)}


def server_label(kv: str, n_ctx: int) -> str:
    """llama-server's churn side as run: its KV layout says how many cells it had."""
    cells = (f"-kvu -c {n_ctx}: one pool of {n_ctx} cells, as the daemon" if kv == "unified"
             else f"-c {n_ctx * CHURN_SLOTS}: {n_ctx} cells per slot")
    return f"llama-server -np {CHURN_SLOTS} {cells}, --cache-ram {LLAMA_SERVER_CACHE_RAM_MB}"


CHURN_SIDES = {  # key, label
    "cache": "sfcore daemon, cache on (default [cache], fresh dir)",
    "cold": "sfcore daemon, all cold (`cache_prompt: false`)",
    "llama-server": "llama-server",  # labelled as run: server_label
}


def print_churn(churn: dict[str, dict[str, Any]], rounds: int,
                n_ctx: int) -> list[dict[str, Any]]:
    print(f"2. Churn: {CHURN_CLIENTS} clients x {rounds} rounds, {CHURN_PROMPTS} system "
          f"prompts of ~{CHURN_PROMPT_TOKENS} tokens + a question (client c sends prompt "
          f"c + round), {CHURN_SLOTS} slots, {CHURN_TOKENS} greedy tokens; first token seen "
          "by the client, queueing included; round 0 (filling the caches) not measured")
    print()
    print("| side | mean first token ms | median ms | max ms | requests | cached share of "
          "prompt tokens | cache_source counts | round 0 mean ms | x all-cold mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    cold = churn.get("cold", {}).get("mean_ms", float("nan"))
    for key, side_label in CHURN_SIDES.items():
        side = churn.get(key)
        if side is None:
            continue
        label = server_label(side["kv"], n_ctx) if key == "llama-server" else side_label
        sources = ", ".join(f"{k} {v}" for k, v in sorted(side["sources"].items()))
        print(f"| {label} | {side['mean_ms']:.1f} | {side['median_ms']:.1f} | "
              f"{side['max_ms']:.1f} | {side['requests']} | {side['cached_share']:.3f} | "
              f"{sources} | {side['round_0_mean_ms']:.1f} | {side['mean_ms'] / cold:.3f} |")
    print()
    cache = churn["cache"]
    disk = cache["disk"]
    print(f"3. The caching daemon after the churn: RSS {cache['rss_mb']:.1f} MB (peak "
          f"{cache['peak_rss_mb']:.1f} MB); cache dir {disk['files']} files, "
          f"{disk['bytes'] / 2**20:.1f} MiB ({disk['allocated_bytes'] / 2**20:.1f} MiB "
          f"allocated) of the {DISK_MB} MiB disk budget ([cache] disk_mb).")
    print(f"   info.config.cache: {json.dumps(cache.get('config_cache'))}")
    print(f"   stats.cache: {json.dumps(cache.get('stats_cache'))}")
    targets = [{"target": "churn: daemon cache mean <= 0.2 x all-cold",
                "measured": cache["mean_ms"] / cold, "met": cache["mean_ms"] / cold <= 0.2}]
    if "llama-server" in churn:
        ratio = cache["mean_ms"] / churn["llama-server"]["mean_ms"]
        targets.append({"target": "churn: daemon cache mean <= "
                                  f"{server_label(churn['llama-server']['kv'], n_ctx)} mean",
                        "measured": ratio, "met": ratio <= 1.0})
    return targets


# --- the section ---------------------------------------------------------------------------------


def add_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--churn-rounds", type=int, default=3,
                        help="measured rounds of the churn (default 3)")


def run(bench: Bench) -> dict[str, Any]:
    return measure(bench.params, bench.runs, bench.llama_server, bench.args.churn_rounds,
                   runner=bench.runner, header=bench.header)


def measure(params: dict[str, Any], runs: int, llama_server: str | None, churn_rounds: int, *,
            runner: Runner, header: str) -> dict[str, Any]:
    """Both parts, the tables and the targets; the JSON fields. `runner` runs a coroutine to
    completion (uvloop.run); each call starts and stops its own daemons."""
    problems = peer_paths(llama_server=llama_server)
    if problems:
        raise SystemExit("; ".join(problems))
    workdir = Path(tempfile.mkdtemp(prefix="sfbench-cache-", dir="/tmp"))
    try:
        samples: list[dict[str, Any]] = []
        prefix: str | None = None
        for index in range(runs):
            log(f"[cache {index + 1}/{runs}] restore: cold, slot, RAM, disk ...")
            sample = runner(restore_run(params, workdir, index, prefix))
            prefix = sample.pop("prefix")
            samples.append(sample)
            log("  first token ms: " + ", ".join(
                f"{key.removesuffix('_mean')} {sample[f'{key}_ms']:.0f}"
                f" ({sample.get(key.removesuffix('_mean') + '_source')})"
                for key, _ in RESTORE_ROWS))
        churn: dict[str, dict[str, Any]] = {}
        log(f"[cache] churn: daemon with its cache, {churn_rounds} rounds ...")
        churn["cache"] = runner(churn_daemon(params, workdir, churn_rounds, False, None))
        prompts = churn["cache"].pop("prompts")
        if llama_server:
            log(f"[cache] churn: llama-server --cache-ram {LLAMA_SERVER_CACHE_RAM_MB} ...")
            churn["llama-server"] = churn_server(llama_server, params, prompts, churn_rounds)
        log("[cache] churn: daemon, all cold ...")
        churn["cold"] = runner(churn_daemon(params, workdir, churn_rounds, True, prompts))
        churn["cold"].pop("prompts")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"Prompt cache: {header}")
    print()
    targets = print_restore(samples)
    print()
    targets += print_churn(churn, churn_rounds, params["n_ctx"])
    print()
    print("| target | measured | met |")
    print("|---|---|---|")
    for row in targets:
        shown = "nan" if math.isnan(row["measured"]) else f"{row['measured']:.3f}"
        print(f"| {row['target']} | {shown} | {'yes' if row['met'] else 'NO'} |")
    problems_seen = [line for sample in samples for line in sample["log_problems"]] + [
        line for side in ("cache", "cold") for line in churn[side]["log_problems"]]
    if problems_seen:
        log(f"[cache] {len(problems_seen)} prompt-cache, WARNING or ERROR lines in the "
            "daemons' logs, e.g.:")
        for line in problems_seen[:10]:
            log(f"  {line}")
    restore_stats = {f"{key}_ms": summary([s[f"{key}_ms"] for s in samples])
                     for key, _ in RESTORE_ROWS}
    return {"restore": {"samples": samples, "stats": restore_stats},
            "churn": churn, "churn_rounds": churn_rounds, "targets": targets,
            "daemon_log_problems": problems_seen}
