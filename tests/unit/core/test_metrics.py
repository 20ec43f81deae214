"""Prometheus metrics (core/metrics.py): GET /metrics, the `metrics` op and
`sfcore stats --prometheus`, read with prometheus_client's reference parser.

The live test makes real generations (NDJSON and HTTP) and checks what the scrapes
say against the replies' own usage: token totals, one first-token and one queue-wait
observation per generation, one inter-token gap per token after a generation's first;
counters never go back between two scrapes; buckets are cumulative up to +Inf.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_metrics.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from sfcore_daemon.core.histogram import Histogram
from sfcore_daemon.core.metrics import Exposition

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=200, deadline=None)
# (The format ends a HELP line's text at the line's end: whitespace around it is not kept.)
@given(help_text=_text.map(str.strip),
       values=st.dictionaries(_text, st.integers(0, 2**53), min_size=1, max_size=5),
       gauge=st.floats(allow_nan=False) | st.integers(-(2**53), 2**53))
def test_label_values_and_help_survive_the_reference_parser(
        help_text: str, values: dict[str, int], gauge: float) -> None:
    out = Exposition()
    out.by("things_total", "counter", help_text, "what", values)
    out.one("level", "gauge", help_text, gauge)
    families = {family.name: family for family in
                text_string_to_metric_families(out.text())}
    things = families["sfcore_things"]
    assert things.type == "counter" and things.documentation == help_text
    assert {sample.labels["what"]: sample.value for sample in things.samples} == values
    assert [sample.name for sample in things.samples] == ["sfcore_things_total"] * len(values)
    (level,) = families["sfcore_level"].samples
    assert level.value == gauge and families["sfcore_level"].documentation == help_text


def test_histogram_buckets_are_cumulative_and_a_bound_holds_its_own_value() -> None:
    histogram = Histogram((0.001, 0.01))
    for ns in (0, 1_000_000, 1_000_001, 10_000_000, 10_000_001, 5 * 10**9):
        histogram.observe_ns(ns)
    out = Exposition()
    out.histogram("wait_seconds", "a wait", histogram)
    (family,) = text_string_to_metric_families(out.text())
    samples = {(sample.name, sample.labels.get("le")): sample.value for sample in family.samples}
    assert samples == {
        ("sfcore_wait_seconds_bucket", "0.001"): 2,  # le: 0 and exactly 1 ms
        ("sfcore_wait_seconds_bucket", "0.01"): 4,
        ("sfcore_wait_seconds_bucket", "+Inf"): 6,
        ("sfcore_wait_seconds_count", None): 6,
        ("sfcore_wait_seconds_sum", None): pytest.approx(5.022000002),
    }


