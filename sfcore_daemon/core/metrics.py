"""What the daemon counts, in Prometheus' text exposition format 0.0.4.

Served by `GET /metrics` on the OpenAI listener, the `metrics` op and `sfcore stats
--prometheus` (for node_exporter's textfile collector). Written by hand to the format's
specification (a few lines; no runtime dependency); the tests parse it with
prometheus_client's reference parser. Event loop only: everything read here is the
loop's own (`Stats`, the scheduler, the prompt store's figures) or a plain int the
decode thread stores (`Engine.step_counts`).

Names carry their unit (`_seconds`, `_bytes`, `_tokens`), counters end in `_total`.
docs/operations.md (Metrics) lists the series.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from sfcore_daemon.core.histogram import Histogram
from sfcore_daemon.core.state import ServerState
from sfcore_daemon.engine.costdrift import DRIFT

if TYPE_CHECKING:
    import psutil

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MetricType = Literal["counter", "gauge", "histogram"]
Labels = tuple[tuple[str, str], ...]
Sample = tuple[Labels, float]


class Exposition:
    """The text of one scrape, family by family."""

    def __init__(self, prefix: str = "sfcore_") -> None:
        self.prefix = prefix
        self._lines: list[str] = []

    def family(self, name: str, kind: MetricType, help_text: str,
               samples: Iterable[Sample]) -> None:
        """A counter or gauge: HELP, TYPE, one line per label set (counters' names
        end in `_total`; the caller's name includes it)."""
        full = self.prefix + name
        self._head(full, kind, help_text)
        for labels, value in samples:
            self._lines.append(f"{full}{_labels(labels)} {_number(value)}")

    def one(self, name: str, kind: MetricType, help_text: str, value: float) -> None:
        self.family(name, kind, help_text, [((), value)])

    def by(self, name: str, kind: MetricType, help_text: str, label: str,
           values: dict[str, int]) -> None:
        self.family(name, kind, help_text,
                    [(((label, key),), value) for key, value in values.items()])

    def histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        """`_bucket{le}` cumulative up to +Inf, `_sum` in seconds, `_count`."""
        full = self.prefix + name
        self._head(full, "histogram", help_text)
        cumulative = histogram.cumulative()
        bounds = [_number(bound) for bound in histogram.bounds] + ["+Inf"]
        for bound, count in zip(bounds, cumulative, strict=True):
            self._lines.append(f'{full}_bucket{{le="{bound}"}} {count}')
        self._lines.append(f"{full}_sum {_number(histogram.sum_ns / 1e9)}")
        self._lines.append(f"{full}_count {cumulative[-1]}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n" if self._lines else ""

    def _head(self, full: str, kind: MetricType, help_text: str) -> None:
        help_escaped = help_text.replace("\\", "\\\\").replace("\n", "\\n")
        self._lines.append(f"# HELP {full} {help_escaped}")
        self._lines.append(f"# TYPE {full} {kind}")


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in labels) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def exposition(state: ServerState) -> str:
    """The whole scrape: what `Stats` counts, the scheduler and store now, the process."""
    out = Exposition()
    stats = state.stats
    out.family("requests_total", "counter", "Requests received, by op and by the API "
               "they came through (ndjson, chat_completions, completions, responses, "
               "messages).",
               [((("api", api), ("op", op)), count)
                for (op, api), count in sorted(stats.by_op_api.items())])
    out.by("generations_total", "counter", "Generations ended, by outcome (finish reason, "
           "or error).", "outcome", stats.by_outcome)
    out.by("errors_total", "counter", "Error replies, by error code.", "code", stats.errors)
    out.one("prompt_tokens_total", "counter", "Prompt tokens of ended generations (cached "
            "ones included).", stats.prompt_tokens)
    out.one("cached_prompt_tokens_total", "counter", "Prompt tokens reused from a slot or "
            "the prompt store instead of evaluated.", stats.cached_tokens)
    out.one("generated_tokens_total", "counter", "Tokens generated.", stats.generated_tokens)
    out.one("drafted_tokens_total", "counter", "Tokens drafted by speculative decoding.",
            stats.drafted_tokens)
    out.one("accepted_tokens_total", "counter", "Drafted tokens the model accepted.",
            stats.accepted_tokens)
    out.one("forced_drafted_tokens_total", "counter", "Of the drafted tokens, those a JSON "
            "schema's grammar forced.", stats.forced_drafted)
    out.one("forced_accepted_tokens_total", "counter", "Of the accepted tokens, those a JSON "
            "schema's grammar forced.", stats.forced_accepted)
    _store(out, state)
    _engine(out, state)
    out.one("connections", "gauge", "NDJSON connections open now.", stats.connections_current)
    out.one("connections_accepted_total", "counter", "NDJSON connections accepted.",
            stats.connections_total)
    out.one("connections_rejected_total", "counter", "NDJSON connections refused "
            "(server.max_connections).", stats.connections_rejected)
    out.one("http_connections", "gauge", "HTTP connections open now (OpenAI listener).",
            stats.http_current)
    out.one("http_connections_accepted_total", "counter", "HTTP connections accepted.",
            stats.http_total)
    out.by("http_connections_closed_total", "counter", "HTTP connections the daemon closed, "
           "by why: a time limit, room made for another, or refused.", "reason",
           stats.http_closed)
    out.by("http_responses_total", "counter", "HTTP replies, by status.", "status",
           stats.http_responses)
    out.histogram("first_token_seconds", "Time from a generation's arrival to its first "
                  "token.", stats.first_token)
    out.histogram("inter_token_gap_seconds", "Time between a generation's consecutive "
                  "tokens (0 for tokens of one speculative step).", stats.token_gap)
    out.histogram("queue_wait_seconds", "Time from a generation's arrival to its start on "
                  "the decode thread.", stats.queue_wait)
    out.one("process_resident_memory_bytes", "gauge", "Resident memory of the daemon "
            "process.", _rss())
    out.one("uptime_seconds", "gauge", "Seconds since the daemon started.",
            round(time.monotonic() - stats.started, 3))
    return out.text()


def _store(out: Exposition, state: ServerState) -> None:
    engine = state.engine
    cache = state.stats.cache_counts(engine.store if engine is not None else None)
    out.by("prompt_cache_hits_total", "counter", "Generations that reused a cached prompt "
           "prefix, by where it was: a slot, the prompt store's RAM or disk tier.", "tier",
           cache.hits)
    out.by("prompt_store_bytes", "gauge", "Bytes of prompt states the prompt store holds, "
           "by tier.", "tier", {"ram": cache.ram_bytes, "disk": cache.disk_bytes})
    out.by("prompt_store_states", "gauge", "Prompt states the prompt store holds, by tier.",
           "tier", {"ram": cache.ram_states, "disk": cache.disk_files})


def _engine(out: Exposition, state: ServerState) -> None:
    scheduler, engine = state.scheduler, state.engine
    out.one("queue_depth", "gauge", "Generations waiting for a slot.",
            scheduler.queue_depth if scheduler is not None else 0)
    out.one("slots", "gauge", "Slots (sequences decoded together).", state.config.server.slots)
    out.one("slots_busy", "gauge", "Slots running a generation now.",
            scheduler.busy_slots if scheduler is not None else 0)
    steps, tokens = engine.step_counts if engine is not None else (0, 0)
    out.one("decode_steps_total", "counter", "Decode steps (one llama_decode each).", steps)
    out.one("step_tokens_total", "counter", "Tokens the decode steps held (prompt and "
            "generated rows); divided by decode_steps_total: tokens per step.", tokens)
    out.one("preempted_steps_total", "counter", "Prompt-only steps stopped so that a newer "
            "interactive request starts (what they had read is kept).",
            engine.preempted_steps if engine is not None else 0)
    drift = engine.cost_drift if engine is not None else None
    ratio = drift.ratio() if drift is not None else None
    out.one("step_costs_drift", "gauge", "Steps of several rows against one-row steps: "
            "their time over what the measured step costs say (1: as measured; 0 until "
            f"enough steps were seen). Past {DRIFT} either way the costs are measured again "
            "at the next start.", round(ratio, 3) if ratio is not None else 0)
    threads = engine.threads if engine is not None else None
    out.one("decode_threads", "gauge", "Decode threads in force now (fewer than "
            "configured while other processes hold the cores; runtime.adaptive_threads).",
            threads.threads if threads is not None else 0)
    out.one("decode_thread_changes_total", "counter", "Times the decode thread count "
            "changed.", threads.changes if threads is not None else 0)


def _rss() -> int:
    rss: int = _this_process().memory_info().rss
    return rss


@functools.cache
def _this_process() -> psutil.Process:
    import psutil  # at the first scrape: start-up need not pay its import

    return psutil.Process()
