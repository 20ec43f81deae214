"""The chat template's sandbox budget (issue 50): a template that loops or grows without
end is stopped within its time or size budget, never a thread spinning forever; real
templates render exactly as in jinja's own sandbox; a configured template past the
budget stops the daemon at start-up with one line.

This file holds the tests that need no daemon and no model; those of the daemon's
process (start-up, exit) in tests/lifecycle/test_sandbox.py.
"""

from __future__ import annotations

import time
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sfcore_daemon.core import sandbox
from sfcore_daemon.core.chat import TemplateBudgetError, resolve_template

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' "
          "+ message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _render(source: str, **context: Any) -> str:
    environment = sandbox.BudgetedSandbox(trim_blocks=True, lstrip_blocks=True,
                                          undefined=jinja2.StrictUndefined)
    return sandbox.render(environment.from_string(source), context)


@pytest.mark.parametrize(("source", "context"), [
    # Time: nested loops with nothing to write.
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", {}),
    # Time: loops over the request's own list, nested.
    ("{% for a in messages %}{% for b in messages %}{% for c in messages %}"
     "{% endfor %}{% endfor %}{% endfor %}",
     {"messages": sandbox.BudgetedList(range(3000))}),
    # Size: one operator that would build a gigabyte.
    ("{{ 'x' * 1000000000 }}", {}),
    ("{% set s = namespace(v='ab') %}{% for i in range(64) %}{% set s.v = s.v + s.v %}"
     "{% endfor %}{{ s.v }}", {}),
    ("{{ 2 ** 100000000 }}", {}),
    # Size: output that grows past the cap a piece at a time.
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", {}),
])
def test_a_runaway_template_is_stopped_within_its_budget(source: str,
                                                         context: dict[str, Any]) -> None:
    started = time.monotonic()
    with pytest.raises(sandbox.TemplateBudgetExceeded):
        _render(source, **context)
    # Stopped by the budget, not run to its end (which would take hours or gigabytes).
    assert time.monotonic() - started < sandbox.RENDER_TIME_BUDGET_S + 5


def test_the_budget_is_per_render_and_the_thread_renders_again() -> None:
    with pytest.raises(sandbox.TemplateBudgetExceeded):
        _render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}")
    assert _render("{{ range(3)|list|length }} {{ 3 in range(5) }}") == "3 True"


messages_strategy = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                           "content": st.text(max_size=200)}), max_size=12)


@settings(max_examples=200, deadline=None)
@given(messages=messages_strategy)
def test_a_real_template_renders_as_in_jinjas_own_sandbox(
        messages: list[dict[str, str]]) -> None:
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          undefined=jinja2.StrictUndefined)
    expected = plain.from_string(CHATML).render(messages=messages, add_generation_prompt=True)
    budgeted = _render(CHATML, messages=sandbox.BudgetedList(messages),
                       add_generation_prompt=True)
    assert budgeted == expected


def test_a_chat_past_the_budget_is_refused_as_a_template_error() -> None:
    template = resolve_template(
        model_template=None,
        configured="{% for m in messages %}{% for n in messages %}{% for o in messages %}"
                   "{% for p in messages %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}"
                   "{{ messages[-1]['content'] }}",
        architecture="llama", bos_token="", eos_token="")
    assert template is not None  # four messages: fast at start-up
    with pytest.raises(TemplateBudgetError, match="past its budget"):
        template.render([("user", str(index)) for index in range(2000)])
