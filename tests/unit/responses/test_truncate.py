"""`truncation: "auto"`'s search (responses/truncate.py), fast: the first cut that fits
is found by bisection, with a few counts of the prompt rather than one per message."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.responses.truncate import _first_fitting
from tests.kit.mapping import FAST


@FAST
@given(st.lists(st.integers(1, 10_000), unique=True, max_size=300).map(sorted),
       st.integers(0, 10_001))
def test_the_first_fitting_cut_is_found_in_few_counts(cuts: list[int], threshold: int) -> None:
    counted: list[int] = []

    async def fits(cut: int) -> bool:
        counted.append(cut)
        return cut >= threshold  # dropping more leaves fewer tokens

    found = asyncio.run(_first_fitting(cuts, fits))
    expected = next((index for index, cut in enumerate(cuts) if cut >= threshold), len(cuts))
    assert found == expected
    assert len(counted) <= max(1, len(cuts)).bit_length()
