"""Whether a draft pays for itself, on the decode thread: what a step of r logit rows
costs on this model and machine (measured before serving), and how likely a sequence's
next draft token is to be accepted (from its match, how drafts fared lately and its own
verifications).

A draft of k tokens, each accepted with probability p while the ones before it were,
adds p + p^2 + ... + p^k tokens to its step in expectation and makes the step's r rows
r + k. A step's drafts are given the lengths (none included) that give the step the
most tokens per second, the likeliest sequence first. On the default model a row costs
about a quarter of a step (a row of logits over 262,144 tokens), on SmolLM2-135M about
0.4 of one: the same draft pays on one and loses on the other, which no fixed rule
knows (docs/performance/speculative.md).
"""

from __future__ import annotations

from sfcore_daemon.llama.stepcost import DEPTH, DEPTH_KEY, FAR_DEPTH_KEY

# A draft must promise this much more throughput than the step without it: the
# measurements are noisy, and a draft that only breaks even costs host time.
_MARGIN = 1.02
# The longest draft StepCosts.least_paying considers: draft_max (at most 256) and the
# rows that aligning a step may add (row_multiple - 1, at most 63).
_LONGEST = 320


# Context cells a step's depth is rounded down to, for the kept least_paying bounds.
_DEPTH_STEP = 256


def attended_ns(depth: int, near_ns: float, far_ns: float) -> float:
    """What one row adds to a step by the `depth` cells it attends to, at `near_ns` a
    cell up to stepcost.DEPTH and `far_ns` past it."""
    if depth <= DEPTH:
        return depth * near_ns
    return DEPTH * near_ns + (depth - DEPTH) * far_ns


class StepCosts:
    """The time of a step by its logit rows: the sizes measured at start-up
    (llama/stepcost.py), the others drawn between and past them, plus what each row
    adds for each cell of context it attends to (measured too), at the `depth` the
    step loop sets for the step at hand. Fixed for the daemon's life, so that the
    drafts of a request do not depend on what it served before (nor on how busy the
    machine was a moment ago)."""

    __slots__ = ("_estimate", "_slope", "_least", "_cell_ns", "_far_cell_ns", "depth")

    def __init__(self, measured: dict[int, float], most_rows: int) -> None:
        """`measured`: rows -> ns, with 1 and at least one more size; under key 0
        (stepcost.DEPTH_KEY), the ns a row adds per cell of context up to stepcost.DEPTH,
        and under FAR_DEPTH_KEY past it (where missing, the same)."""
        self._cell_ns = max(measured.get(DEPTH_KEY, 0.0), 0.0)
        self._far_cell_ns = max(measured.get(FAR_DEPTH_KEY, self._cell_ns), 0.0)
        # Cells of context of the step being planned (stepbatch.StepBatch.fill).
        self.depth = 0
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
        # (rows, depth // _DEPTH_STEP) -> least_paying(rows) there
        self._least: dict[tuple[int, int], float] = {}

    def cost(self, rows: int) -> float:
        """The estimated ns of a step of `rows` logit rows at the step's depth."""
        return self.cost_at(rows, self.depth)

    def cost_at(self, rows: int, depth: int) -> float:
        """The estimated ns of a step of `rows` logit rows at `depth` cells of context."""
        estimate = self._estimate
        attention = rows * attended_ns(depth, self._cell_ns, self._far_cell_ns)
        if rows < len(estimate):
            return estimate[rows] + attention
        return estimate[-1] + (rows - len(estimate) + 1) * self._slope + attention

    def as_one_row(self, elapsed_ns: int, rows: int) -> int:
        """A step of `rows` logit rows at the step's depth that took `elapsed_ns`, as the
        time of a one-row step with no context at the same pace: what the thread policy
        compares (threadpolicy.py). Its baseline is a one-row step's time; a step of
        drafts or of several requests' tokens, or one deep in a long context, takes
        longer with nothing slowing it down."""
        if rows <= 1 and self.depth == 0:
            return elapsed_ns
        return int(elapsed_ns * self._estimate[1] / self.cost(max(rows, 1)))

    def least_paying(self, rows: int) -> float:
        """A chance of acceptance below which no draft (of 2 to _LONGEST tokens) pays
        at a step of `rows` logit rows and no other draft: `best_length` would keep
        none. Found once per `rows` and kept; a hair under the true bound, so that a
        draft turned away by it is one `best_length` turns away. In text with little to
        copy the gate refuses most drafts proposed: this refuses each with one comparison
        instead of a search of lengths (docs/performance/speculative.md)."""
        key = (rows, self.depth // _DEPTH_STEP)
        least = self._least.get(key)
        if least is None:
            # At the bucket's least depth: the bound for any depth in it is no lower.
            depth, self.depth = self.depth, key[1] * _DEPTH_STEP
            try:
                least = self._least[key] = self._least_paying(rows)
            finally:
                self.depth = depth
        return least

    def _least_paying(self, rows: int) -> float:
        base = rows / self.cost(rows) * _MARGIN
        least = 1.0
        for k in range(2, _LONGEST + 1):
            # Pays where rows + E(p, k) > base * cost(rows + k); E rises with p.
            need = base * self.cost(rows + k) - rows
            if need >= k:
                continue  # not even a draft accepted whole pays
            low, high = 0.0, 1.0
            for _ in range(40):
                middle = (low + high) / 2
                if expected_tokens(middle, k) > need:
                    high = middle
                else:
                    low = middle
            least = min(least, low)
        return max(least - 1e-6, 0.0)

    def ratios(self) -> dict[int, float]:
        """Each size's cost in one-row steps, up to 17 rows and at 32 and 64 (for stats
        and the docs)."""
        one = self._estimate[1]
        return {rows: round(ns / one, 3) for rows, ns in enumerate(self._estimate)
                if 0 < rows <= 17 or rows in (32, 64)}


# A sampled request's draft token is kept only when the sampler draws it, less often than
# the argmax is: its prior is this share of the greedy one.
SAMPLED_TRUST = 0.9


def prior_acceptance(run: int, sampled: bool = False) -> float:
    """Before a sequence's drafts are verified, the chance that a draft token is accepted
    while the ones before it were, by how far the match runs back (the tokens before the
    matched place that equal the text's end): (run + 1) / (run + 4). A long match is a
    copy or a regenerated answer in progress, a short one a phrase that may go either
    way; a fixed prior either drafted the short ones where a row is dear (SmolLM2) or
    never drafted the long ones (docs/performance/speculative.md, "Where p comes from").
    From the text and the request alone, never from the daemon's running figures: a
    seeded request's drafts must not depend on what the daemon served before."""
    chance = (run + 1) / (run + 4)
    return chance * SAMPLED_TRUST if sampled else chance


class AcceptanceBook:
    """How drafts fared lately, daemon-wide, by source (own text, store), kind of request
    (greedy, sampled) and run (by powers of two: 2-3, 4-7, ..., 128 and more): the
    chance a draft token is accepted, for requests without a seed, in place of the
    fixed prior. The same run means another thing on another model and text: on the
    default model a sampled story repeats itself and drafts pay from short runs, on
    SmolLM2 free text a 4-gram match is worth nothing, and no fixed curve served both
    (docs/performance/speculative.md, "Where p comes from"). Decode thread only.

    A seeded request is judged by the fixed prior: its drafts, and so its bytes, must
    not depend on what the daemon served before. A request's first draft from a source
    is judged by the lower of the two (speculative.NgramDrafter.acceptance)."""

    __slots__ = ("_hits", "_misses")

    def __init__(self) -> None:
        size = 2 * 2 * RUN_BUCKETS
        self._hits = [0.0] * size  # accepted draft tokens, decaying
        self._misses = [0.0] * size  # drafts cut short, decaying

    def chance(self, source: int, sampled: bool, run: int) -> float:
        index = _book_index(source, sampled, run)
        hits = self._hits[index]
        prior = prior_acceptance(run, sampled)
        return (hits + _BOOK_PRIOR_WEIGHT * prior) / (
            hits + self._misses[index] + _BOOK_PRIOR_WEIGHT)

    def record(self, source: int, sampled: bool, run: int, drafted: int,
               accepted: int) -> None:
        index = _book_index(source, sampled, run)
        self._hits[index] = self._hits[index] * _BOOK_DECAY + accepted
        self._misses[index] = self._misses[index] * _BOOK_DECAY + (accepted < drafted)


RUN_BUCKETS = 8  # runs by bit length: 2-3, 4-7, 8-15, ..., 128 and more
# The fixed prior counts as this many drafts cut short; each bucket's counts decay by
# this each draft recorded in it (about the last 100 drafts of a bucket count).
_BOOK_PRIOR_WEIGHT = 4.0
_BOOK_DECAY = 0.99


def run_bucket(run: int) -> int:
    """`run`'s bucket, by bit length (2-3, 4-7, ..., 128 and more): 0 to RUN_BUCKETS - 1."""
    return min(max(run.bit_length() - 2, 0), RUN_BUCKETS - 1)


def _book_index(source: int, sampled: bool, run: int) -> int:
    return (source * 2 + sampled) * RUN_BUCKETS + run_bucket(run)


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
    step's rows a multiple of `multiple`, and `longest`. A step without other drafts
    and a chance below `least_paying` is answered at once: no length pays."""
    if tokens == rows and p < costs.least_paying(rows):
        return 0, 0.0
    return search_length(costs, rows, tokens, p, longest=longest, shortest=shortest,
                         multiple=multiple)


def search_length(costs: StepCosts, rows: int, tokens: float, p: float, *, longest: int,
                  shortest: int, multiple: int) -> tuple[int, float]:
    """`best_length` by trying every candidate length."""
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
