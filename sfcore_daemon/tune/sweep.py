"""The sweep: every measurement of the plan on one Bench, the best of each, and how busy
other processes kept the pinned CPUs meanwhile."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sfcore_daemon.tune.bench import DECODE_PROMPT_TOKENS, Bench, Context
from sfcore_daemon.tune.rows import ROW_ROUNDS_PER_RUN, choose_row_multiple, row_sizes

# Results this close to the fastest count as equal; the cheaper setting wins.
TIE_TOLERANCE = 0.02


@dataclass(frozen=True, slots=True)
class Plan:
    decode_threads: tuple[int, ...]
    batch_threads: tuple[int, ...]
    # The first value is the context the decode sweep runs on.
    ubatches: tuple[int, ...]
    runs: int
    decode_tokens: int
    prompt_tokens: int

    @property
    def steps(self) -> int:
        # The last step: the logit-row costs.
        return len(self.decode_threads) + len(self.batch_threads) * len(self.ubatches) + 1


@dataclass(frozen=True, slots=True)
class Result:
    threads: int
    n_ubatch: int
    rates: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def spread(self) -> str:
        return f"{min(self.rates):.1f}-{max(self.rates):.1f}"


@dataclass(slots=True)
class Sweep:
    decode: list[Result] = field(default_factory=list)
    prefill: list[Result] = field(default_factory=list)
    # Median ms of a step by its logit rows, and the decode thread count they ran at.
    row_costs: dict[int, float] = field(default_factory=dict)
    row_threads: int = 1
    # Share of the pinned CPUs' time that other processes took meanwhile.
    others_share: float = 0.0


def run_sweep(bench: Bench, plan: Plan, progress: Callable[[str], None]) -> Sweep:
    prompt = bench.prompt(max(plan.prompt_tokens, DECODE_PROMPT_TOKENS, *plan.ubatches))
    watch = CpuWatch(bench.pinned)
    sweep = Sweep()
    step = 0

    def measure(label: str, run: Callable[[], float]) -> tuple[float, ...]:
        nonlocal step
        step += 1
        rates = tuple(run() for _ in range(plan.runs))
        progress(f"[{step}/{plan.steps}] {label}: {statistics.median(rates):.1f} tok/s")
        return rates

    for index, n_ubatch in enumerate(plan.ubatches):
        with bench.context(n_ubatch) as context:
            context.warm_up(prompt)
            if index == 0:
                for threads in plan.decode_threads:
                    rates = measure(f"decode threads={threads}", partial(
                        context.decode_rate, prompt, threads, plan.decode_tokens))
                    sweep.decode.append(Result(threads, n_ubatch, rates))
                step += 1
                progress(f"[{step}/{plan.steps}] logit rows a step: "
                         f"{_measure_rows(context, prompt, plan, sweep)}")
            for threads in plan.batch_threads:
                rates = measure(f"prefill threads_batch={threads} n_ubatch={n_ubatch}", partial(
                    context.prefill_rate, prompt, plan.prompt_tokens, threads))
                sweep.prefill.append(Result(threads, n_ubatch, rates))
    sweep.others_share = watch.others_share()
    sweep.prefill.sort(key=lambda r: (r.n_ubatch, r.threads))
    return sweep


def _measure_rows(context: Context, prompt: Any, plan: Plan, sweep: Sweep) -> str:
    """Step costs by logit rows into `sweep`, at the best decode thread count."""
    if context.n_batch < max(row_sizes()):
        return f"not measured (n_batch {context.n_batch} is below {max(row_sizes())})"
    sweep.row_threads = best(sweep.decode).threads
    sweep.row_costs = context.row_costs(prompt, sweep.row_threads, row_sizes(),
                                        plan.runs * ROW_ROUNDS_PER_RUN)
    return f"row_multiple {choose_row_multiple(sweep.row_costs)}"


def best(results: Sequence[Result]) -> Result:
    """The cheapest result (fewest threads, then smallest n_ubatch) within TIE_TOLERANCE
    of the fastest: the same speed for less CPU and less memory."""
    fastest = max(result.median for result in results)
    close = [r for r in results if r.median >= fastest * (1 - TIE_TOLERANCE)]
    return min(close, key=lambda r: (r.threads, r.n_ubatch))


class CpuWatch:
    """How much of the pinned CPUs' time went to other processes (or the hypervisor).

    The daemon's threads normally have their CPUs to themselves; on a busy machine
    more threads look slower than they are, so such a sweep is flagged.
    """

    def __init__(self, pinned: Sequence[int]) -> None:
        import psutil

        self._process = psutil.Process()
        self._pinned = list(pinned)
        self._start = self._snapshot()

    def others_share(self) -> float:
        wall, busy, own = (end - start for end, start in zip(
            self._snapshot(), self._start, strict=True))
        capacity = wall * len(self._pinned)
        return max(0.0, (busy - own) / capacity) if capacity > 0 else 0.0

    def _snapshot(self) -> tuple[float, float, float]:
        import psutil

        per_cpu = psutil.cpu_times(percpu=True)
        busy = sum(_busy_seconds(per_cpu[cpu]) for cpu in self._pinned if cpu < len(per_cpu))
        own = self._process.cpu_times()
        return time.monotonic(), busy, float(own.user + own.system)


def _busy_seconds(times: Any) -> float:
    # As psutil.cpu_percent counts it: guest time is already inside user and nice,
    # and steal counts as busy (a vCPU the hypervisor gave away was not ours either).
    not_busy = float(times.idle + getattr(times, "iowait", 0.0))
    counted_twice = float(getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0))
    return float(sum(times)) - not_busy - counted_twice
