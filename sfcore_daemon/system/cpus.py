"""CPU pinning with psutil, and the thread counts that follow from the pinned set."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


class CpuError(Exception):
    pass


def pin(cpus: Sequence[int]) -> list[int]:
    """Pin this process (and every thread it starts later) to `cpus`; empty keeps the current set.

    Returns the CPU set the process now runs on.
    """
    if not cpus:
        # Nothing to pin: the standard library reads the mask, and psutil's import stays
        # out of the way of a fast start (docs/performance/design.md).
        return sorted(os.sched_getaffinity(0))
    import psutil

    process = psutil.Process()
    existing = _existing_cpus()
    missing = sorted(set(cpus) - existing)
    if missing:
        raise CpuError(
            f"runtime.cpu_affinity: CPU {', '.join(map(str, missing))} does not exist "
            f"(this machine has CPUs {_ranges(sorted(existing))})"
        )
    try:
        process.cpu_affinity(sorted(set(cpus)))
    except (OSError, ValueError) as exc:
        raise CpuError(f"runtime.cpu_affinity: cannot pin to {list(cpus)}: {exc}") from None
    return sorted(process.cpu_affinity() or [])


def physical_core_count(cpus: Sequence[int]) -> int:
    """Distinct physical cores among `cpus` (SMT siblings count once)."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return len(cpus)  # no topology information: assume no SMT
        cores.add((package, core))
    return len(cores) or len(cpus)


def derive_threads(cpus: Sequence[int], n_threads: int, n_threads_batch: int) -> tuple[int, int]:
    """Decode threads default to physical cores (decode is memory-bound, SMT siblings
    only contend); batch threads default to every logical CPU (prefill is compute-bound)."""
    decode = n_threads or max(1, physical_core_count(cpus))
    batch = n_threads_batch or max(1, len(cpus))
    return decode, batch


def _existing_cpus() -> set[int]:
    try:
        text = Path("/sys/devices/system/cpu/present").read_text().strip()
    except OSError:
        return set(range(os.cpu_count() or 1))
    return set(_parse_ranges(text))


def _parse_ranges(text: str) -> list[int]:
    result: list[int] = []
    for part in text.split(","):
        if "-" in part:
            low, high = part.split("-")
            result.extend(range(int(low), int(high) + 1))
        elif part:
            result.append(int(part))
    return result


def _ranges(cpus: list[int]) -> str:
    if not cpus:
        return "none"
    spans, start, prev = [], cpus[0], cpus[0]
    for cpu in [*cpus[1:], -2]:
        if cpu != prev + 1:
            spans.append(f"{start}-{prev}" if prev != start else str(start))
            start = cpu
        prev = cpu
    return ",".join(spans)
