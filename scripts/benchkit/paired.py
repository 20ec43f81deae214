"""Two daemons measured round by round (scripts/bench.py versions and reproducible): the
round's log line, the table of paired ratios, and the clean-up."""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchkit.common import log
from benchkit.daemon import Daemon, Stream

# (key, label, unit, higher is better)
Figure = tuple[str, str, str, bool]


def log_round(index: int, rounds: int, result: dict[str, dict[str, float]],
              names: Sequence[str]) -> None:
    log(f"[round {index + 1}/{rounds}] " + "; ".join(
        f"{name}: " + ", ".join(f"{value:.1f}" for value in result[name].values())
        for name in names))


async def close(streams: dict[str, tuple[Stream, list[Stream]]], daemons: dict[str, Daemon],
                shared: Path) -> None:
    for stream, clients in streams.values():
        for client in (stream, *clients):
            await client.close()
    for daemon in daemons.values():
        await daemon.stop()
    shutil.rmtree(shared, ignore_errors=True)


def table(samples: dict[str, list[dict[str, float]]], first: str, second: str,
          figures: Sequence[Figure]) -> dict[str, float]:
    """Print each figure's medians (range) and the median of its rounds' ratios,
    first / second oriented so that above 1 is better; the ratios by key."""
    print(f"| figure | unit | {second} | {first} | {first}/{second} (paired, above 1 is "
          "better) |")
    print("|---|---|---|---|---|")
    ratios = {}
    for key, label, unit, higher in figures:
        ones = [run[key] for run in samples[first]]
        others = [run[key] for run in samples[second]]
        paired = [(a / b if higher else b / a) for a, b in zip(ones, others, strict=True)]
        ratios[key] = statistics.median(paired)
        print(f"| {label} | {unit} | {statistics.median(others):.1f} ({min(others):.1f}-"
              f"{max(others):.1f}) | {statistics.median(ones):.1f} ({min(ones):.1f}-"
              f"{max(ones):.1f}) | {ratios[key]:.3f} |")
    return ratios
