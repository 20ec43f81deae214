"""The one table writer: medians with their min-max, paired ratios, markdown rows and the
targets' table every section ends with."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def summary(values: list[float]) -> dict[str, float]:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite)}


def cell(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "-"
    return f"{stats['median']:.1f} ({stats['min']:.1f}-{stats['max']:.1f})"


def paired_ratio(top: list[dict[str, Any]], top_key: str, bottom: list[dict[str, Any]],
                 bottom_key: str) -> float:
    """Median over runs of top/bottom, each pair measured back to back in one run: on a
    shared machine this is steadier than a ratio of two medians."""
    ratios = [a[top_key] / b[bottom_key] for a, b in zip(top, bottom, strict=True)
              if b[bottom_key] and not math.isnan(a[top_key] / b[bottom_key])]
    return statistics.median(ratios) if ratios else float("nan")


def row(*cells: object) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def print_head(*labels: str) -> None:
    """A markdown table's head: its labels and the rule under them."""
    print(row(*labels))
    print("|" + "---|" * len(labels))


def print_targets(checks: Sequence[tuple[str, float, bool]]) -> None:
    """The targets' table: what was aimed at, what was measured, whether it was met."""
    print()
    print_head("target", "measured", "met")
    for label, value, met in checks:
        shown = f"{value:.3f}" if value < 10 else f"{value:.1f}"
        print(row(label, shown, "yes" if met else "NO"))


def targets_json(checks: Sequence[tuple[str, float, bool]]) -> list[dict[str, Any]]:
    return [{"target": label, "measured": value, "met": met} for label, value, met in checks]
