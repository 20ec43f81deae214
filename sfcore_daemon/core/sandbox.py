"""Jinja's immutable sandbox with a time and size budget for each render.

A chat template comes from the model file or the config: untrusted text that runs on
every chat request. jinja2's sandbox stops it reaching Python's internals but not
from looping or growing without end (`range` alone allows 100,000 items, and loops
nest). So each render has a deadline and an output cap, checked where a template
spends its time: every call, attribute and item access, every step of `range` and of
the request's own lists (messages, tools), every piece of output, and the operators
that build big values (`*`, `**`, `+`), before they build them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from jinja2 import Template
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

# Far above any real template (a long chat renders in milliseconds); low enough that a
# runaway one costs a request a second, not the daemon a thread.
RENDER_TIME_BUDGET_S = 1.0
RENDER_SIZE_BUDGET = 16 << 20  # characters: far more than any context holds
_MAX_EXPONENT = 4096
# How many steps of a loop pass between two looks at the clock.
_CHECK_EVERY = 64

_render = threading.local()


class TemplateBudgetExceeded(Exception):
    """A render went past its time or size budget."""


def _check_time() -> None:
    deadline: float | None = getattr(_render, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateBudgetExceeded(
            f"it ran longer than {RENDER_TIME_BUDGET_S:g} s")


def _check_size(size: int) -> None:
    if size > RENDER_SIZE_BUDGET:
        raise TemplateBudgetExceeded(
            f"it built a value or an output over {RENDER_SIZE_BUDGET:,} characters")


class BudgetedList(list[Any]):
    """A list whose iteration looks at the render's clock (the messages and tools a
    request brings, which a template may loop over inside other loops)."""

    def __iter__(self) -> Iterator[Any]:
        for index, item in enumerate(super().__iter__()):
            if index % _CHECK_EVERY == 0:
                _check_time()
            yield item


class _BudgetedRange:
    """The sandbox's `range` (at most 100,000 items) whose iteration looks at the clock."""

    def __init__(self, *args: int) -> None:
        self._range: range = safe_range(*args)

    def __iter__(self) -> Iterator[int]:
        for index, value in enumerate(self._range):
            if index % _CHECK_EVERY == 0:
                _check_time()
            yield value

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: int) -> int:
        return self._range[index]

    def __contains__(self, value: object) -> bool:
        return value in self._range

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._range)

    def __repr__(self) -> str:
        return repr(self._range)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["range"] = _BudgetedRange

    def call(__self, __context: Context, __obj: Any, *args: Any,
             **kwargs: Any) -> Any:
        _check_time()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_time()
        return super().getitem(obj, argument)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, str | list | tuple) and isinstance(count, int):
                    _check_size(len(sequence) * count)
        elif operator == "+" and isinstance(left, str | list | tuple) \
                and isinstance(right, str | list | tuple):
            _check_size(len(left) + len(right))
        elif operator == "**" and isinstance(right, int) and abs(right) > _MAX_EXPONENT:
            raise TemplateBudgetExceeded(f"it raised a number to a power over {_MAX_EXPONENT}")
        return super().call_binop(context, operator, left, right)


def render(template: Template, context: dict[str, Any]) -> str:
    """`template` rendered with `context` within the budget; TemplateBudgetExceeded if
    it goes past it. Any thread (the deadline is the calling thread's)."""
    _render.deadline = time.monotonic() + RENDER_TIME_BUDGET_S
    pieces: list[str] = []
    size = 0
    try:
        for piece in template.generate(context):
            size += len(piece)
            _check_size(size)
            _check_time()
            pieces.append(piece)
    finally:
        _render.deadline = None
    return "".join(pieces)
