"""A Prometheus histogram kept on the event loop: fixed buckets, integer nanoseconds.

Observing is one `bisect` and two integer additions: the inter-token gap histogram
takes one observation per generated token, on the loop, so it must cost next to
nothing (no float conversion, no list or tuple per call). The exposition
(metrics.py) turns the counts into cumulative `le` buckets.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

# Upper bounds in seconds, from a GPU step's gap up to a long prompt's or a full queue's
# wait; a speculative step hands over several tokens at once (gaps of 0).
SECONDS_BUCKETS: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
                          1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class Histogram:
    """Counts of durations by bucket (not cumulative; the last is +Inf) and their sum."""

    __slots__ = ("bounds", "_bounds_ns", "counts", "sum_ns")

    def __init__(self, bounds: tuple[float, ...] = SECONDS_BUCKETS) -> None:
        self.bounds = bounds
        self._bounds_ns = tuple(round(bound * 1e9) for bound in bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.sum_ns = 0

    def observe_ns(self, ns: int) -> None:
        # bisect_left: a value equal to a bound falls in that bound's bucket (`le`).
        self.counts[bisect_left(self._bounds_ns, ns)] += 1
        self.sum_ns += ns

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """The count at or below each bound, then the total (+Inf)."""
        total, out = 0, []
        for count in self.counts:
            total += count
            out.append(total)
        return out
