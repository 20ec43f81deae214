"""How many prompt rows a step takes, by the step costs measured at start-up
(llama/stepcost.py).

Beside interactive streams, when `[server] prefill_per_step` is 0: as many as cost about
what the streams' own rows cost in that step. A long prompt read beside streams then
takes about half of each step's time, and the streams keep about half their pace: a
fixed count of rows costs a stream from a tenth to several times its step, by the model,
the machine and how deep the prompt already is.

Of short rests (prompts with a few tokens left, several waiting at once): the rows that
give them the least mean first token. A step costs a fixed part (its streams' rows, or
one logit row) plus a part per prompt row; reading few rows a step makes every rest
wait for many fixed parts, reading many makes the first wait for the others' rows
(docs/performance/slots.md).
"""

from __future__ import annotations

import math

from sfcore_daemon.engine.draftgate import StepCosts, attended_ns
from sfcore_daemon.llama.stepcost import FAR_PROMPT_CELL_KEY, PROMPT_CELL_KEY, PROMPT_ROW_KEY


class PrefillShare:
    """The prompt rows of a step beside streams, from the measured step costs."""

    __slots__ = ("_steps", "_row_ns", "_cell_ns", "_far_cell_ns")

    def __init__(self, measured: dict[int, float], most_rows: int) -> None:
        """`measured`: as llama/stepcost.py measures them; ValueError without a prompt
        row's cost or without the logit rows' (StepCosts)."""
        self._steps = StepCosts(measured, most_rows)
        self._row_ns = measured.get(PROMPT_ROW_KEY, 0.0)
        self._cell_ns = max(measured.get(PROMPT_CELL_KEY, 0.0), 0.0)
        self._far_cell_ns = max(measured.get(FAR_PROMPT_CELL_KEY, self._cell_ns), 0.0)
        if self._row_ns <= 0.0:
            raise ValueError("step costs without a prompt row's cost")

    def rows(self, streams: int, stream_depth: int, prompt_depth: int) -> int:
        """Prompt rows (at least 1) for a step of `streams` logit rows whose sequences
        hold `stream_depth` cells on average, for a prompt read to `prompt_depth`."""
        streams_ns = self._steps.cost_at(max(streams, 1), stream_depth)
        return max(1, int(streams_ns / self._row_at(prompt_depth)))

    def short_rows(self, streams: int, stream_depth: int, prompt_depth: int,
                   waiting: int) -> int:
        """Rows of short rests (at least 1) for a step of `streams` logit rows besides,
        with `waiting` short rests' rows to read, the first from `prompt_depth`. With a
        step of g such rows costing a + b * g, each rest waits (a + b * g)(waiting / g
        + 1) / 2 on average: least at g = sqrt(a * waiting / b)."""
        fixed_ns = self._steps.cost_at(max(streams, 1), stream_depth)
        return max(1, int(math.sqrt(fixed_ns * max(waiting, 0) / self._row_at(prompt_depth))))

    def _row_at(self, prompt_depth: int) -> float:
        """The ns one prompt row adds to a step, read at `prompt_depth`."""
        return self._row_ns + attended_ns(prompt_depth, self._cell_ns, self._far_cell_ns)


def prefill_share(measured: dict[int, float], most_rows: int) -> PrefillShare | None:
    """The share by `measured`; None without a prompt row's cost (a context or batch too
    small to measure it in: steps then take fixed counts of prompt rows)."""
    try:
        return PrefillShare(measured, most_rows)
    except ValueError:
        return None
