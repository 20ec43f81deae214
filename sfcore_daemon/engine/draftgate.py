"""Whether a draft pays for itself, on the decode thread: what a step of r logit rows
costs on this model and machine (measured before serving), and how likely a sequence's
next draft token is to be accepted (from its own verifications).

A draft of k tokens, each accepted with probability p while the ones before it were,
adds p + p^2 + ... + p^k tokens to its step in expectation and makes the step's r rows
r + k. A step's drafts are given the lengths (none included) that give the step the
most tokens per second, the likeliest sequence first. On the default model a row costs
about a quarter of a step (a row of logits over 262,144 tokens), on SmolLM2-135M about
0.4 of one: the same draft pays on one and loses on the other, which no fixed rule
knows (docs/performance.md, "Speculative decoding").
"""

from __future__ import annotations

# A draft must promise this much more throughput than the step without it: the
# measurements are noisy, and a draft that only breaks even costs host time.
_MARGIN = 1.02


class StepCosts:
    """The time of a step by its logit rows: the sizes measured at start-up
    (llama/stepcost.py), the others drawn between and past them. Fixed for the
    daemon's life, so that the drafts of a request do not depend on what it served
    before (nor on how busy the machine was a moment ago)."""

    __slots__ = ("_estimate", "_slope")

    def __init__(self, measured: dict[int, float], most_rows: int) -> None:
        """`measured`: rows -> ns, with 1 and at least one more size."""
        sizes = sorted(rows for rows in measured if rows > 0)
        if len(sizes) < 2 or sizes[0] != 1:
            raise ValueError("step costs need a one-row step and one more size")
        estimate = [0.0] * (max(most_rows, sizes[-1]) + 1)
        # Past the largest size, each row costs the mean row of the measured range (the
        # last two sizes may straddle a kernel's tile edge).
        last = sizes[-1]
        slope = max((measured[last] - measured[1]) / (last - 1), 0.0)
        for rows in range(1, len(estimate)):
            if rows in measured:
                estimate[rows] = measured[rows]
            elif rows > last:
                estimate[rows] = measured[last] + (rows - last) * slope
            else:
                low = max(size for size in sizes if size < rows)
                high = min(size for size in sizes if size > rows)
                share = (rows - low) / (high - low)
                estimate[rows] = measured[low] + share * (measured[high] - measured[low])
        self._estimate = estimate
        self._slope = slope

    def cost(self, rows: int) -> float:
        """The estimated ns of a step of `rows` logit rows."""
        estimate = self._estimate
        if rows < len(estimate):
            return estimate[rows]
        return estimate[-1] + (rows - len(estimate) + 1) * self._slope

    def ratios(self) -> dict[int, float]:
        """Each size's cost in one-row steps, up to 17 rows (for stats and the docs)."""
        one = self._estimate[1]
        return {rows: round(ns / one, 3) for rows, ns in enumerate(self._estimate)
                if 0 < rows <= 17}


# Before a sequence's drafts are verified, each source's chance that a draft token is
# accepted while the ones before it were: about what the bench's edit prompts accept
# from their own text, less from the store of earlier answers (which also serves
# requests that only share a phrase with one). Constants, not the daemon's running
# figures: a request's drafts must not depend on what the daemon served before.
PRIOR_ACCEPTANCE = (0.75, 0.6)  # own text, the store of earlier answers


def expected_tokens(p: float, k: int) -> float:
    """The tokens a draft of `k` adds in expectation, each accepted with probability `p`
    while the ones before it were: p + p^2 + ... + p^k."""
    if p >= 1.0:
        return float(k)
    return p * (1.0 - p ** k) / (1.0 - p)


def best_length(costs: StepCosts, rows: int, tokens: float, p: float, *, longest: int,
                shortest: int, multiple: int) -> tuple[int, float]:
    """The draft length (0, or `shortest` to `longest`) that gives a step of `rows`
    logit rows and `tokens` expected tokens the most tokens per second, and the
    expected tokens it adds. Lengths tried: each up to 8, then those that make the
    step's rows a multiple of `multiple`, and `longest`."""
    base_rate = tokens / costs.cost(rows)
    best, best_rate, best_gain = 0, base_rate * _MARGIN, 0.0
    step = max(multiple, 1)
    candidates = set(range(shortest, min(longest, 8) + 1))
    candidates.update(range(shortest + (-(rows + shortest)) % step, longest + 1, step))
    candidates.add(longest)
    for k in candidates:
        if k < shortest:
            continue
        gain = expected_tokens(p, k)
        rate = (tokens + gain) / costs.cost(rows + k)
        if rate > best_rate:
            best, best_rate, best_gain = k, rate, gain
    return best, best_gain
