#!/usr/bin/env python3
"""Concurrent speculative stress: the crash check of issue 37 (standard library only).

`--clients` threads (8), each on its own connection, send greedy streaming `generate`
requests one after another for `--seconds`, with the daemon's own speculative settings
(the default config drafts up to 64 tokens), cycling through prompts of mixed lengths
(`--lengths`: a short one, ~500 and ~1500 tokens; each starts with a distinct number, so
no prompt shares a prefix with another and every one is evaluated beside other requests'
draft rows). Requests under way at the deadline are waited for (up to
`--request-timeout`).

Printed and written to `--json`: requests, how each ended (done, error codes, lost
connections, timeouts), per prompt length the tokens and drafts, whether the daemon
process (`--pid`) is still alive and answers `health`. Exit status 0 only if at least one
request was sent per client, every request ended `done`, and the daemon is alive.

  spec_stress.py --socket S [--seconds 60] [--clients 8] [--max-tokens 256]
                 [--lengths short,500,1500] [--pid PID] [--log DAEMON-LOG] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from typing import Any

SHORT = "The quick brown fox jumps over the lazy dog. Once upon a time"
PARA = ("In the quiet valley beyond the river, the old mill turned slowly while farmers "
        "carried grain along the dusty road, talking about the weather, the harvest, the "
        "prices at the market and the news from distant cities. ")


def say(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] stress:", *parts, flush=True)


class Lost(Exception):
    """The connection ended mid-reply (the daemon died or dropped it)."""


class Conn:
    def __init__(self, path: str, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.lines = self.sock.makefile("rb")

    def request(self, message: dict[str, Any], deadline: float) -> tuple[dict[str, Any], float]:
        """Send one request and read its reply up to the final line; (final, first token s)."""
        sent = time.perf_counter()
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        first = -1.0
        while True:
            if time.perf_counter() > deadline:
                raise TimeoutError("request deadline passed")
            line = self.lines.readline()
            if not line:
                raise Lost("connection closed mid-reply")
            reply: dict[str, Any] = json.loads(line)
            if reply.get("type") == "token":
                if first < 0:
                    first = time.perf_counter() - sent
                continue
            return reply, first

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


def one_call(path: str, message: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    conn = Conn(path, timeout)
    try:
        return conn.request(message, time.perf_counter() + timeout)[0]
    finally:
        conn.close()


def prompts(path: str, lengths: list[str]) -> dict[str, str]:
    """A text per length: "short", or a paragraph repeated to about N tokens."""
    out = {}
    for spec in lengths:
        if spec == "short":
            out[spec] = SHORT
            continue
        target = int(spec)
        reps = max(1, target // 40)
        n = len(one_call(path, {"op": "tokenize", "text": PARA * reps})["tokens"])
        reps = max(1, round(reps * target / n))
        out[spec] = PARA * reps
    return out


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.by_length: dict[str, dict[str, Any]] = {}
        self.failures: list[dict[str, Any]] = []
        self.started = 0

    def add(self, length: str, outcome: str, final: dict[str, Any] | None, first: float,
            detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            row = self.by_length.setdefault(length, {
                "requests": 0, "done": 0, "prompt_tokens": [], "completion_tokens": 0,
                "drafted_tokens": 0, "accepted_tokens": 0, "first_token_ms": []})
            row["requests"] += 1
            if outcome == "done" and final is not None:
                usage = final.get("usage", {})
                row["done"] += 1
                row["prompt_tokens"].append(usage.get("prompt_tokens", 0))
                row["completion_tokens"] += usage.get("completion_tokens", 0)
                row["drafted_tokens"] += usage.get("drafted_tokens", 0)
                row["accepted_tokens"] += usage.get("accepted_tokens", 0)
                if first >= 0:
                    row["first_token_ms"].append(first * 1000)
            elif len(self.failures) < 20:
                self.failures.append({"length": length, "outcome": outcome,
                                      "detail": detail[:300], "t": round(time.time(), 3)})


def client(index: int, a: argparse.Namespace, texts: dict[str, str], stop_at: float,
           tally: Tally) -> None:
    order = list(texts)
    n = 0
    conn: Conn | None = None
    while time.perf_counter() < stop_at:
        length = order[(index + n) % len(order)]
        n += 1
        message: dict[str, Any] = {
            "op": "generate", "id": f"c{index}-{n}", "stream": True, "temperature": 0,
            "prompt": f"{index * 100003 + n * 7919}. {texts[length]}",
            "max_tokens": a.max_tokens}
        with tally.lock:
            tally.started += 1
        try:
            if conn is None:
                conn = Conn(a.socket, a.request_timeout)
            final, first = conn.request(message, time.perf_counter() + a.request_timeout)
        except (Lost, ConnectionError) as exc:
            tally.add(length, "lost", None, -1, repr(exc))
            break  # the daemon is gone or dropped us: do not spin on a dead socket
        except (TimeoutError, OSError) as exc:
            tally.add(length, "timeout" if isinstance(exc, TimeoutError) else "oserror",
                      None, -1, repr(exc))
            break
        if final.get("type") == "done":
            tally.add(length, "done", final, first)
        else:
            code = final.get("code") or final.get("type")
            tally.add(length, f"error:{code}", final, first, json.dumps(final))
    if conn is not None:
        conn.close()


def alive(pid: int | None) -> bool | None:
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


# What a dying daemon (or llama.cpp under it) leaves in its log.
FATAL = re.compile(r"CUDA error|illegal|Traceback|GGML_ASSERT|Aborted|core dumped|"
                   r"Segmentation|terminate called| ERROR ")


def read_log(path: str | None, dead: bool) -> dict[str, Any]:
    """The daemon log's placement line and its fatal-looking lines (its tail if it died)."""
    if not path:
        return {}
    try:
        with open(path, errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        return {"daemon_log": f"unreadable: {exc}"}
    placement = [line for line in lines if re.search(r": model: \d+/\d+ layers", line)]
    out: dict[str, Any] = {
        "placement": placement[-1].split(": model: ", 1)[1] if placement else None,
        "daemon_log_fatal": [line[:300] for line in lines if FATAL.search(line)][:15]}
    if dead:
        out["daemon_log_tail"] = [line[:300] for line in lines[-20:]]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", required=True)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--lengths", default="short,500,1500",
                   help="comma-separated: short, or a prompt length in tokens")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--pid", type=int, help="the daemon's process id (alive check)")
    p.add_argument("--log", help="the daemon's log: its placement and fatal lines are reported")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args()

    texts = prompts(a.socket, a.lengths.split(","))
    tally = Tally()
    say(f"{a.clients} clients, {a.seconds:.0f} s, max_tokens {a.max_tokens}, prompt "
        f"lengths {a.lengths}, speculation as the daemon's config says")
    t0 = time.perf_counter()
    stop_at = t0 + a.seconds
    threads = [threading.Thread(target=client, args=(i, a, texts, stop_at, tally), daemon=True)
               for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(a.seconds + a.request_timeout + 10)
    wall = time.perf_counter() - t0
    hung = sum(t.is_alive() for t in threads)

    is_alive = alive(a.pid)
    if is_alive and tally.outcomes["done"] < sum(tally.outcomes.values()):
        # A lost connection may be the daemon dying: its sockets close before the process
        # is gone (a CUDA abort tears its context down for a while). Give it 10 s to end.
        give_up = time.perf_counter() + 10
        while is_alive and time.perf_counter() < give_up:
            time.sleep(0.1)
            is_alive = alive(a.pid)
    try:
        health = one_call(a.socket, {"op": "health"}).get("status")
    except (OSError, ValueError, Lost) as exc:
        health = f"no answer: {exc!r}"
    done = tally.outcomes["done"]
    requests = sum(tally.outcomes.values())
    by_length = {}
    for length, row in tally.by_length.items():
        prompt_tokens, ttft = row.pop("prompt_tokens"), row.pop("first_token_ms")
        row["prompt_tokens_median"] = statistics.median(prompt_tokens) if prompt_tokens else None
        row["first_token_ms_median"] = round(statistics.median(ttft), 1) if ttft else None
        by_length[length] = row
    tokens = sum(row["completion_tokens"] for row in by_length.values())
    ok = (requests >= a.clients and done == requests and hung == 0
          and is_alive is not False and health == "ok")
    result = {
        "ok": ok, "clients": a.clients, "seconds": a.seconds, "wall_s": round(wall, 1),
        "max_tokens": a.max_tokens, "lengths": a.lengths, "requests": requests, "done": done,
        "errors": requests - done, "outcomes": dict(tally.outcomes), "hung_clients": hung,
        "completion_tokens": tokens, "aggregate_tok_s": round(tokens / wall, 1),
        "daemon_alive": is_alive, "health_after": health, "by_length": by_length,
        "failures": tally.failures,
        **read_log(a.log, is_alive is False),
    }
    say(f"requests {requests}, done {done}, errors {requests - done} {dict(tally.outcomes)}, "
        f"{tokens} tokens in {wall:.1f} s ({tokens / wall:.0f} tok/s); daemon alive: "
        f"{is_alive}, health: {health}; {'OK' if ok else 'FAILED'}")
    for length, row in by_length.items():
        say(f"  {length}: {row}")
    for failure in tally.failures[:5]:
        say("  failure:", failure)
    for line in result.get("daemon_log_fatal", [])[:5]:
        say("  daemon log:", line)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
