"""Soak: many clients, every op, cancels and vanishing clients, for over 10,000
generated tokens against one daemon. Afterwards the daemon's memory and file
descriptors have not grown, and its `stats` counters match what the clients know.

The workload is random but seeded (one RNG per worker), bounded in iterations and
time. What the clients count, and how exactly each counter can be compared:

- A request whose final line the client read was certainly read by the daemon: it
  counts exactly (requests.total, by_op, by_outcome, errors, tokens from `usage`).
- A client that vanishes after its generation streamed a first token: the daemon
  read and ran it, so requests.total and by_op.generate count it exactly, and its
  prompt tokens are known (a fixed prompt, tokenized once by the `tokenize` op). Its
  outcome is `cancelled` unless the model happened to stop at that very moment
  (`stop`), and the tokens it generated before the daemon noticed are at least the
  one the client read and, generously, at most MAX_TOKENS_AFTER_VANISH.
- A client that vanishes right after sending a line may or may not have had it
  read: those add to an upper bound only ("maybe" counts).
- Connections: every connect is accepted (max_connections is far above the
  workers' needs), so connections.total is exact once every client has closed and
  the daemon noticed (connections.current back to the monitor's 1, polled).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.kit import FINAL_TYPES, Client, Daemon, running_daemon
from tests.kit.faults import fd_targets, open_fds, poll_until, rss_anon_mb, vm_rss_mb

pytestmark = pytest.mark.asyncio

# idle_timeout_s 0: the monitor connection sits idle for a whole phase (idle timeouts
# have their own tests in test_faults.py).
# Speculation on, with short drafts: its rows' logits (1 MiB each, at most draft_max
# rows a step) are touched as drafts first reach a length, a bounded one-time growth.
DRAFT_MAX = 8
CONFIG = {"server": {"max_queue": 256, "max_connections": 64, "idle_timeout_s": 0},
          "model": {"n_ctx": 4096}, "generation": {"max_tokens": 96},
          "speculative": {"draft_max": DRAFT_MAX, "draft_start": 4}}
SEED = 20_251_122
WORKERS = 4
TOKEN_TARGET = 10_000
WARMUP_TOKENS = 1_500
MAX_ITERATIONS = 3_000  # per worker and phase; the token target ends a phase long before
RSS_GROWTH_LIMIT_MB = 20.0 + DRAFT_MAX
MAX_TOKENS_AFTER_VANISH = 64
REPLY_TIMEOUT_S = 120.0

VANISH_PROMPT = "Write a very long story about a lighthouse keeper."
PROMPTS = [
    "Jelaskan Rust dalam 1 kalimat",
    "Once upon a time, in a village by the sea,",
    "List some fruits: apple, banana,",
    "The three laws of thermodynamics are",
    "def fibonacci(n):",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "Q: Why is the sky blue?\nA:",
    "Grüße aus München! Das Wetter heute",
]
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.",
             "Explain recursion briefly.", "Give me three tips for sleeping well.",
             "Apa itu kecerdasan buatan?"]
OPS = ("generate", "chat", "tokenize", "detokenize", "info", "stats", "health", "cancel")


@dataclass
class Ledger:
    """What the clients know the daemon did."""

    total: int = 0
    by_op: Counter[str] = field(default_factory=Counter)
    by_outcome: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    prompt: int = 0
    cached: int = 0
    generated: int = 0
    connections: int = 0
    # Generations whose client vanished after their first token (read and run).
    vanished_running: int = 0
    # Generate lines sent by clients that vanished at once (read or not).
    maybe_generate: int = 0
    ops_seen: Counter[str] = field(default_factory=Counter)
    doing: dict[int, str] = field(default_factory=dict)  # each worker's action, for failures

    def read(self, op: str | None) -> None:
        self.total += 1
        if op is not None:
            self.by_op[op] += 1

    def ended(self, done: dict[str, Any]) -> None:
        assert done["type"] == "done", done
        self.by_outcome[done["finish_reason"]] += 1
        usage = done["usage"]
        self.prompt += usage["prompt_tokens"]
        self.cached += usage["cached_tokens"]
        self.generated += usage["completion_tokens"]


async def read_reply(client: Client, timeout: float = REPLY_TIMEOUT_S) -> list[dict[str, Any]]:
    """Every line of the next request's reply, up to its final line (any op)."""
    lines = []
    while True:
        reply = await client.recv(timeout)
        assert reply is not None, f"connection closed mid-reply after {lines}"
        lines.append(reply)
        if reply["type"] in FINAL_TYPES:
            return lines


def final_of(lines: list[dict[str, Any]], request_id: Any, kind: str) -> dict[str, Any]:
    final = lines[-1]
    assert final["id"] == request_id, (request_id, final)
    assert final["type"] == kind, (kind, final)
    assert all(line["id"] == request_id for line in lines), lines
    return final


class Worker:
    def __init__(self, number: int, daemon: Daemon, ledger: Ledger, prompt_tokens: int,
                 seed: int) -> None:
        self.number = number
        self.daemon = daemon
        self.ledger = ledger
        self.vanish_prompt_tokens = prompt_tokens
        self.rng = random.Random(seed)
        self.home: Client | None = None
        self.ids = itertools.count()
        self.known_tokens: list[int] = [2, 9259]
        actions = {
            self.generate: 20, self.chat: 8, self.tokenize: 6, self.detokenize: 5,
            self.info: 2, self.stats: 3, self.health: 4, self.pipelined: 4,
            self.cancel_running: 3, self.cancel_pipelined: 3, self.cancel_unknown: 2,
            self.bad_json: 3, self.invalid: 3, self.overflow: 1, self.vanish_streaming: 3,
            self.vanish_at_once: 2, self.vanish_silent: 2, self.half_close: 2,
        }
        self.actions = list(actions)
        self.weights = list(actions.values())

    def new_id(self) -> str:
        return f"w{self.number}-{next(self.ids)}"

    async def connect(self) -> Client:
        client = await self.daemon.connect()
        self.ledger.connections += 1
        return client

    async def client(self) -> Client:
        if self.home is not None and self.rng.random() < 0.03:
            await self.home.close()  # connections come and go
            self.home = None
        if self.home is None:
            self.home = await self.connect()
        return self.home

    async def close(self) -> None:
        if self.home is not None:
            await self.home.close()
            self.home = None

    async def run(self, until_tokens: int, cover_all: bool = False) -> None:
        # The warm-up runs every action once first, so that whatever the daemon sets up
        # lazily on first use is in place before memory and descriptors are measured.
        first = self.rng.sample(self.actions, len(self.actions)) if cover_all else []
        for iteration in range(MAX_ITERATIONS):
            if iteration >= len(first) and self.ledger.generated >= until_tokens:
                break
            if iteration < len(first):
                action = first[iteration]
            else:
                action = self.rng.choices(self.actions, self.weights)[0]
            self.ledger.ops_seen[action.__name__] += 1
            self.ledger.doing[self.number] = f"{action.__name__} since {time.monotonic():.1f}"
            await action()
        await self.close()

    # --- requests whose answer the client reads ---

    def generation_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "max_tokens": self.rng.randint(64, 128),
            "stream": self.rng.random() < 0.7,
            "temperature": self.rng.choice([0, 0.8]),
            "seed": self.rng.randint(0, 1_000_000),
            "cache_prompt": self.rng.random() < 0.8,
        }
        if self.rng.random() < 0.2:
            options["stop"] = self.rng.choice(["\n\n", ["\n", "."], "the"])
        return options

    async def _generation(self, request: dict[str, Any], op: str) -> None:
        client = await self.client()
        await client.send(request)
        lines = await read_reply(client)
        done = final_of(lines, request["id"], "done")
        self.ledger.read(op)
        self.ledger.ended(done)

    async def generate(self) -> None:
        await self._generation({"id": self.new_id(), "prompt": self.rng.choice(PROMPTS),
                                **self.generation_options()}, "generate")

    async def chat(self) -> None:
        messages = [{"role": "user", "content": self.rng.choice(QUESTIONS)}]
        if self.rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        await self._generation({"id": self.new_id(), "op": "chat", "messages": messages,
                                **self.generation_options()}, "chat")

    async def _simple(self, request: dict[str, Any], kind: str) -> dict[str, Any]:
        client = await self.client()
        await client.send(request)
        final = final_of(await read_reply(client), request["id"], kind)
        self.ledger.read(request["op"])
        return final

    async def tokenize(self) -> None:
        text = self.rng.choice(PROMPTS + QUESTIONS) * self.rng.randint(1, 3)
        reply = await self._simple({"id": self.new_id(), "op": "tokenize", "text": text},
                                   "tokens")
        assert reply["tokens"] and all(isinstance(t, int) for t in reply["tokens"])
        self.known_tokens = reply["tokens"]

    async def detokenize(self) -> None:
        tokens = self.known_tokens[:self.rng.randint(1, len(self.known_tokens))]
        reply = await self._simple({"id": self.new_id(), "op": "detokenize",
                                    "tokens": tokens}, "text")
        assert isinstance(reply["text"], str)

    async def info(self) -> None:
        reply = await self._simple({"id": self.new_id(), "op": "info"}, "info")
        assert reply["model"]["n_vocab"] > 0

    async def stats(self) -> None:
        reply = await self._simple({"id": self.new_id(), "op": "stats"}, "stats")
        assert reply["requests"]["total"] >= 1

    async def health(self) -> None:
        reply = await self._simple({"id": self.new_id(), "op": "health"}, "health")
        assert reply["status"] == "ok"

    async def pipelined(self) -> None:
        client = await self.client()
        ids = [self.new_id() for _ in range(4)]
        await client.send({"id": ids[0], "op": "health"},
                          {"id": ids[1], "op": "tokenize", "text": "pipelined"},
                          {"id": ids[2], "prompt": self.rng.choice(PROMPTS), "max_tokens": 8},
                          {"id": ids[3], "op": "stats"})
        final_of(await read_reply(client), ids[0], "health")
        final_of(await read_reply(client), ids[1], "tokens")
        done = final_of(await read_reply(client), ids[2], "done")
        final_of(await read_reply(client), ids[3], "stats")
        for op in ("health", "tokenize", "generate", "stats"):
            self.ledger.read(op)
        self.ledger.ended(done)

    async def cancel_running(self) -> None:
        client = await self.client()
        target, cancel_id = self.new_id(), self.new_id()
        await client.send({"id": target, "prompt": VANISH_PROMPT, "max_tokens": 2000,
                           "temperature": 0.8, "seed": self.rng.randint(0, 1000)})
        first = await client.recv(REPLY_TIMEOUT_S)
        assert first is not None and first["id"] == target, first
        await client.send({"id": cancel_id, "op": "cancel", "target": target})
        lines = [first] if first["type"] in FINAL_TYPES else [first, *await read_reply(client)]
        done = final_of(lines, target, "done")
        cancelled = final_of(await read_reply(client), cancel_id, "cancelled")
        assert cancelled["target"] == target
        # Cancelled, unless it ended on its own before the cancel was read.
        assert cancelled["found"] == (done["finish_reason"] == "cancelled"), (done, cancelled)
        assert done["usage"]["completion_tokens"] < 2000
        self.ledger.read("generate")
        self.ledger.read("cancel")
        self.ledger.ended(done)

    async def cancel_pipelined(self) -> None:
        client = await self.client()
        target, cancel_id = self.new_id(), self.new_id()
        await client.send({"id": target, "prompt": self.rng.choice(PROMPTS),
                           "max_tokens": 2000, "stream": self.rng.random() < 0.5},
                          {"id": cancel_id, "op": "cancel", "target": target})
        done = final_of(await read_reply(client), target, "done")
        cancelled = final_of(await read_reply(client), cancel_id, "cancelled")
        # Queued or just started when the cancel was read: found, and it stopped early.
        assert cancelled["found"] is True, (done, cancelled)
        assert done["finish_reason"] == "cancelled", done
        self.ledger.read("generate")
        self.ledger.read("cancel")
        self.ledger.ended(done)

    async def cancel_unknown(self) -> None:
        client = await self.client()
        request = {"id": self.new_id(), "op": "cancel", "target": f"nobody-{self.new_id()}"}
        await client.send(request)
        reply = final_of(await read_reply(client), request["id"], "cancelled")
        assert reply["found"] is False
        self.ledger.read("cancel")

    async def bad_json(self) -> None:
        client = await self.client()
        await client.send(self.rng.choice([b"{oops\n", b"[1, 2]\n", b'{"prompt": NaN}\n',
                                           b'{"prompt": "\xff"}\n']))
        reply = await client.recv(REPLY_TIMEOUT_S)
        assert reply is not None and reply.get("code") == "bad_json", reply
        self.ledger.read(None)
        self.ledger.errors["bad_json"] += 1

    async def invalid(self) -> None:
        client = await self.client()
        request = self.rng.choice([{"prompt": "x", "max_tokens": 0}, {"op": "explode"},
                                   {"prompt": "x", "tempreature": 1},
                                   {"op": "cancel"}, {"op": "detokenize", "tokens": [-5]}])
        request_id = self.new_id()
        await client.send({"id": request_id, **request})
        reply = final_of(await read_reply(client), request_id, "error")
        assert reply["code"] == "invalid_request", reply
        self.ledger.read(None)  # not a valid request of any op: no by_op count
        self.ledger.errors["invalid_request"] += 1

    async def overflow(self) -> None:
        client = await self.client()
        request_id = self.new_id()
        await client.send({"id": request_id, "prompt": "word " * 5000, "max_tokens": 4})
        reply = final_of(await read_reply(client), request_id, "error")
        assert reply["code"] == "context_overflow", reply
        self.ledger.read("generate")
        self.ledger.by_outcome["error"] += 1
        self.ledger.errors["context_overflow"] += 1

    async def half_close(self) -> None:
        client = await self.connect()
        try:
            ids = [self.new_id(), self.new_id()]
            await client.send({"id": ids[0], "op": "health"},
                              {"id": ids[1], "prompt": self.rng.choice(PROMPTS),
                               "max_tokens": self.rng.randint(64, 128)})
            client.writer.write_eof()
            final_of(await read_reply(client), ids[0], "health")
            done = final_of(await read_reply(client), ids[1], "done")
            await client.expect_eof(timeout=30)
            self.ledger.read("health")
            self.ledger.read("generate")
            self.ledger.ended(done)
        finally:
            await client.close()

    # --- clients that vanish ---

    async def vanish_streaming(self) -> None:
        client = await self.connect()
        request_id = self.new_id()
        try:
            await client.send({"id": request_id, "prompt": VANISH_PROMPT, "max_tokens": 2000,
                               "temperature": 0.8, "seed": self.rng.randint(0, 1000)})
            first = await client.recv(REPLY_TIMEOUT_S)
            assert first is not None and first["id"] == request_id, first
        finally:
            await client.close()
        if first["type"] == "queued":
            # Gone while it waited for a slot: it may still have started, or never.
            self.ledger.maybe_generate += 1
            return
        self.ledger.read("generate")
        if first["type"] == "done":  # ended before a token: an ordinary, counted request
            self.ledger.ended(first)
        else:
            self.ledger.vanished_running += 1

    async def vanish_at_once(self) -> None:
        client = await self.connect()
        await client.send({"id": self.new_id(), "prompt": VANISH_PROMPT, "max_tokens": 2000})
        await client.close()
        self.ledger.maybe_generate += 1

    async def vanish_silent(self) -> None:
        client = await self.connect()
        await client.close()


async def run_phase(daemon: Daemon, ledger: Ledger, prompt_tokens: int, phase: int,
                    until_tokens: int) -> None:
    workers = [Worker(n, daemon, ledger, prompt_tokens, SEED + 100 * phase + n)
               for n in range(WORKERS)]
    await asyncio.gather(*(w.run(until_tokens, cover_all=phase == 0)
                           for w in workers))


async def settled_stats(monitor: Client, ledger: Ledger) -> dict[str, Any]:
    """Stats once every client but the monitor has closed and the daemon noticed (no
    event says so: polled, boundedly). Each poll is a request the ledger counts."""

    async def stats() -> dict[str, Any]:
        await monitor.send({"id": "settle", "op": "stats"})
        reply = final_of(await read_reply(monitor), "settle", "stats")
        ledger.read("stats")
        return reply

    return await poll_until(stats, lambda s: s["connections"]["current"] == 1,
                            timeout=15, interval=0.05, what="every client connection closed")


async def settled_fds(pid: int) -> int:
    """The daemon's open descriptors once closing connections have let go of theirs: a
    transport closes its socket a few loop turns after the daemon forgets the
    connection, so the least of a second of samples is taken (no event reports it)."""
    samples = []
    for _ in range(10):
        samples.append(open_fds(pid))
        await asyncio.sleep(0.1)
    return min(samples)


def check_counters(stats: dict[str, Any], ledger: Ledger, prompt_tokens: int) -> None:
    requests, tokens = stats["requests"], stats["tokens"]
    vanished, maybe = ledger.vanished_running, ledger.maybe_generate
    problems = []

    def expect(name: str, got: int, low: int, high: int | None = None) -> None:
        high = low if high is None else high
        if not low <= got <= high:
            problems.append(f"{name}: daemon {got}, clients expect "
                            f"{low if low == high else f'{low}..{high}'}")

    expect("requests.total", requests["total"], ledger.total, ledger.total + maybe)
    for op in OPS:
        extra = maybe if op == "generate" else 0
        expect(f"by_op.{op}", requests["by_op"][op], ledger.by_op[op], ledger.by_op[op] + extra)
    outcomes = requests["by_outcome"]
    for outcome in ("length", "stop_sequence", "error"):
        expect(f"by_outcome.{outcome}", outcomes[outcome], ledger.by_outcome[outcome])
    # A vanished generation ended `cancelled`, or `stop` if the model stopped right then.
    expect("by_outcome.cancelled", outcomes["cancelled"], ledger.by_outcome["cancelled"],
           ledger.by_outcome["cancelled"] + vanished + maybe)
    expect("by_outcome.stop", outcomes["stop"], ledger.by_outcome["stop"],
           ledger.by_outcome["stop"] + vanished + maybe)
    expect("by_outcome.cancelled+stop", outcomes["cancelled"] + outcomes["stop"],
           ledger.by_outcome["cancelled"] + ledger.by_outcome["stop"] + vanished,
           ledger.by_outcome["cancelled"] + ledger.by_outcome["stop"] + vanished + maybe)
    for code in ("bad_json", "invalid_request", "context_overflow", "queue_full",
                 "line_too_long", "too_many_connections", "forbidden", "shutting_down",
                 "internal"):
        expect(f"errors.{code}", stats["errors"][code], ledger.errors[code])
    expect("tokens.prompt", tokens["prompt"], ledger.prompt + vanished * prompt_tokens,
           ledger.prompt + (vanished + maybe) * prompt_tokens)
    expect("tokens.cached", tokens["cached"], ledger.cached,
           ledger.cached + (vanished + maybe) * prompt_tokens)
    expect("tokens.generated", tokens["generated"], ledger.generated + vanished,
           ledger.generated + (vanished + maybe) * MAX_TOKENS_AFTER_VANISH)
    expect("connections.total", stats["connections"]["total"], ledger.connections)
    expect("connections.current", stats["connections"]["current"], 1)
    expect("connections.rejected", stats["connections"]["rejected"], 0)
    if not stats["decode_tok_s"] > 0:
        problems.append(f"decode_tok_s: {stats['decode_tok_s']}")
    assert not problems, "\n".join(problems) + f"\nstats: {stats}\nledger: {ledger}"


@pytest.mark.slow
# A hang bound only (every reply has its own REPLY_TIMEOUT_S): phases end at a token
# count, never at a wall-clock deadline, so a loaded machine makes the test slower,
# not red. It takes about 2 minutes on an idle 2-core machine.
@pytest.mark.timeout(2400)
async def test_soak_every_op_with_cancels_and_vanishing_clients() -> None:
    started = time.monotonic()
    async with running_daemon(CONFIG) as daemon:
        pid = daemon.process.pid
        ledger = Ledger()
        monitor = await daemon.connect()
        ledger.connections += 1
        try:
            await monitor.send({"id": "p", "op": "tokenize", "text": VANISH_PROMPT})
            prompt_tokens = len(final_of(await read_reply(monitor), "p", "tokens")["tokens"])
            ledger.read("tokenize")

            await run_phase(daemon, ledger, prompt_tokens, 0, WARMUP_TOKENS)
            await settled_stats(monitor, ledger)
            baseline_anon, baseline_rss = rss_anon_mb(pid), vm_rss_mb(pid)
            baseline_fds = await settled_fds(pid)
            baseline_targets = fd_targets(pid)
            warm = time.monotonic()

            await run_phase(daemon, ledger, prompt_tokens, 1, TOKEN_TARGET)
            stats = await settled_stats(monitor, ledger)
            anon, rss, fds = rss_anon_mb(pid), vm_rss_mb(pid), await settled_fds(pid)
            print(f"\nsoak: {ledger.generated} tokens known generated in "
                  f"{time.monotonic() - started:.0f} s ({time.monotonic() - warm:.0f} s after "
                  f"warm-up); {ledger.total} requests, {ledger.connections} connections, "
                  f"{ledger.vanished_running} vanished mid-stream, {ledger.maybe_generate} "
                  f"vanished at once; actions {dict(ledger.ops_seen)}")
            print(f"soak: RssAnon {baseline_anon:.1f} -> {anon:.1f} MB, VmRSS "
                  f"{baseline_rss:.1f} -> {rss:.1f} MB, fds {baseline_fds} -> {fds}")
            print(f"soak: daemon stats {stats}")

            assert ledger.generated >= TOKEN_TARGET, (
                f"only {ledger.generated} tokens in {MAX_ITERATIONS} iterations per worker")
            check_counters(stats, ledger, prompt_tokens)
            assert anon - baseline_anon < RSS_GROWTH_LIMIT_MB, (baseline_anon, anon)
            assert fds <= baseline_fds, (baseline_fds, fds, baseline_targets, fd_targets(pid))
        except BaseException:
            print(f"\nsoak failed at {time.monotonic():.1f}; workers: {ledger.doing}")
            print("daemon log (tail):\n" + daemon.log[-30_000:])
            raise
        finally:
            await monitor.close()
