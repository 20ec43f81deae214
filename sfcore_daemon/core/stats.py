"""Counters since start, for the `stats` op. Kept on the event loop only.

The decode thread never touches these: a generation's figures are added when its
outcome is decided on the loop (its `done` or `error` line, or its client leaving).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sfcore_daemon.core.counts import (
    CacheCounts,
    ConnectionCounts,
    GrammarCounts,
    HttpCounts,
    RequestCounts,
    SlotUse,
    SpeculativeCounts,
    StatsSnapshot,
    ThreadCounts,
    TokenCounts,
)
from sfcore_daemon.core.errors import ERROR_CODES
from sfcore_daemon.core.histogram import Histogram
from sfcore_daemon.core.result import FINISH_REASONS
from sfcore_daemon.engine.costdrift import CostDrift
from sfcore_daemon.store.promptstore import PromptStore

OUTCOMES = (*FINISH_REASONS, "error")
# Why the OpenAI listener closed a connection: one of its time limits, evicted to make room
# at max_connections, or refused after its request (429, 403); see docs/openai.md.
HTTP_CLOSED = ("first_request_timeout", "idle_timeout", "header_timeout", "body_timeout",
               "write_timeout", "evicted", "refused")
# Always present (so that each has its series from the start); others as they occur.
HTTP_STATUSES = ("200", "400", "401", "403", "404", "408", "413", "429", "500", "503")
# The (op, api) pairs of the listener's own routes; each front end adds its own pairs
# (`count_ops`) before it serves, so that every series is there from the start.
LISTENER_OPS = (("metrics", "http"),)


class Stats:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests_total = 0
        self.by_op: dict[str, int] = {}
        # (op, api) -> requests: the `requests_total` series.
        self.by_op_api: dict[tuple[str, str], int] = {}
        self.count_ops(LISTENER_OPS)
        self.by_outcome = dict.fromkeys(OUTCOMES, 0)
        self.errors = dict.fromkeys(ERROR_CODES, 0)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.connections_current = 0
        self.connections_total = 0
        self.connections_rejected = 0
        self.http_current = 0
        self.http_total = 0
        self.http_closed = dict.fromkeys(HTTP_CLOSED, 0)
        self.http_responses = dict.fromkeys(HTTP_STATUSES, 0)
        # Tokens after each generation's first, and the time they took (for the mean rate).
        self._decode_tokens = 0
        self._decode_ns = 0
        # Constrained generations: tokens checked against a grammar, and those the
        # grammar rejected (each cost a second, masked draw).
        self.grammar_requests = 0
        self.grammar_tokens = 0
        self.grammar_resampled = 0
        self.grammar_closed_early = 0
        # Speculative decoding: generations that drafted, tokens drafted and accepted.
        self.speculative_requests = 0
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.forced_drafted = 0
        self.forced_accepted = 0
        self.draft_steps = 0
        self.aligned_steps = 0
        self.logit_rows = 0
        # The prompt store: generations by where their cached rows came from.
        self.cache_hits = {"slot": 0, "ram": 0, "disk": 0}
        self.restored_tokens = 0
        # Latencies for /metrics, observed by `Generation`: arrival to first token and to
        # the decode thread's start, and each token's gap after the one before it.
        self.first_token = Histogram()
        self.queue_wait = Histogram()
        self.token_gap = Histogram()


    def count_ops(self, pairs: Iterable[tuple[str, str]]) -> None:
        """The (op, api) pairs a front end counts, each at 0 until its first request."""
        for op, api in pairs:
            self.by_op.setdefault(op, 0)
            self.by_op_api.setdefault((op, api), 0)

    def count_request(self, op: str, api: str) -> None:
        """One request of the core's `op`, arrived through the front end `api`."""
        self.by_op[op] = self.by_op.get(op, 0) + 1
        key = (op, api)
        self.by_op_api[key] = self.by_op_api.get(key, 0) + 1

    def generation_ended(self, outcome: str, prompt_tokens: int, cached_tokens: int,
                         completion_tokens: int, decode_ns: int) -> None:
        self.by_outcome[outcome] += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.generated_tokens += completion_tokens
        if completion_tokens > 1 and decode_ns > 0:
            self._decode_tokens += completion_tokens - 1
            self._decode_ns += decode_ns

    def http_response(self, status: int) -> None:
        key = str(status)
        self.http_responses[key] = self.http_responses.get(key, 0) + 1

    def http_counts(self) -> HttpCounts:
        return HttpCounts(current=self.http_current, total=self.http_total,
                          closed=dict(self.http_closed), responses=dict(self.http_responses))

    def cache_hit(self, source: str, cached_tokens: int) -> None:
        if source in self.cache_hits:
            self.cache_hits[source] += 1
            if source != "slot":
                self.restored_tokens += cached_tokens

    def cache_counts(self, store: PromptStore | None) -> CacheCounts:
        if store is None:
            return CacheCounts(enabled=False, hits=dict(self.cache_hits), restored_tokens=0,
                               saved=0, written=0, ram_bytes=0, ram_states=0, disk_bytes=0,
                               disk_files=0, ram_evicted=0, disk_evicted=0, errors=0)
        ram_bytes, ram_states, disk_bytes, disk_files = store.figures()
        counters = store.counters
        return CacheCounts(
            enabled=True, hits=dict(self.cache_hits), restored_tokens=self.restored_tokens,
            saved=counters.saved, written=counters.written, ram_bytes=ram_bytes,
            ram_states=ram_states, disk_bytes=disk_bytes, disk_files=disk_files,
            ram_evicted=counters.ram_evicted, disk_evicted=counters.disk_evicted,
            errors=counters.errors)

    def snapshot(self, slots: list[SlotUse], store: PromptStore | None,
                 threads: ThreadCounts, drift: CostDrift | None = None) -> StatsSnapshot:
        rate = self._decode_tokens * 1e9 / self._decode_ns if self._decode_ns else 0.0
        return StatsSnapshot(
            uptime_s=round(time.monotonic() - self.started, 3),
            requests=RequestCounts(total=self.requests_total, by_op=dict(self.by_op),
                                   by_outcome=dict(self.by_outcome)),
            tokens=TokenCounts(prompt=self.prompt_tokens, cached=self.cached_tokens,
                               generated=self.generated_tokens),
            errors=dict(self.errors),
            connections=ConnectionCounts(current=self.connections_current,
                                         total=self.connections_total,
                                         rejected=self.connections_rejected),
            http=self.http_counts(),
            decode_tok_s=round(rate, 2),
            slots=slots,
            grammar=GrammarCounts(requests=self.grammar_requests, tokens=self.grammar_tokens,
                                  resampled=self.grammar_resampled,
                                  closed_early=self.grammar_closed_early),
            speculative=SpeculativeCounts(requests=self.speculative_requests,
                                          drafted=self.drafted_tokens,
                                          accepted=self.accepted_tokens,
                                          steps=self.draft_steps,
                                          aligned_steps=self.aligned_steps,
                                          logit_rows=self.logit_rows,
                                          forced_drafted=self.forced_drafted,
                                          forced_accepted=self.forced_accepted,
                                          step_costs_drift=_rounded(drift),
                                          step_costs_drifted=drift is not None
                                          and drift.drifted()),
            cache=self.cache_counts(store),
            threads=threads,
        )


def _rounded(drift: CostDrift | None) -> float | None:
    ratio = drift.ratio() if drift is not None else None
    return round(ratio, 3) if ratio is not None else None
