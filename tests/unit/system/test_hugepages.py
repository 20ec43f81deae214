"""Huge pages under the weights and the context's buffers (system/hugepages.py): the
maps parser, and a real daemon whose report is the kernel's.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_hugepages.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.system import hugepages

MAPS = """\
55c5a4f84000-55c5a642a000 rw-p 00000000 00:00 0                          [heap]
7f5470021000-7f5474000000 ---p 00000000 00:00 0
7f5476e37000-7f5477637000 rw-p 00000000 00:00 0
7f54869b3000-7f548c5cf000 r--s 001b3000 fe:00 5382176                    /m/model.gguf
7f548c5fc000-7f548c9fe000 rw-s 00000000 00:05 12                         /dev/zero (deleted)
7f548ce13000-7f548cf4b000 r-xp 00013000 fe:00 5309401                    /lib/libggml-cpu.so
7f548e644000-7f548e778000 rw-p 00443000 fe:00 26933                      /lib/libpython3.11.so
7ffd1c5e1000-7ffd1c602000 rw-p 00000000 00:00 0                          [stack]
"""


def test_only_private_writable_anonymous_regions_and_the_heap_are_taken() -> None:
    assert hugepages.anonymous_regions(MAPS) == {
        (0x55c5a4f84000, 0x55c5a642a000), (0x7f5476e37000, 0x7f5477637000)}


def test_a_region_counts_only_its_whole_huge_pages() -> None:
    page = hugepages.HUGE_PAGE
    assert hugepages.whole_huge_pages((page - 1, 3 * page + 5)) == (page, 3 * page)
    assert hugepages.whole_huge_pages((1, 2 * page - 1)) is None


def test_kernel_releases_and_thp_modes_are_read(tmp_path: Path) -> None:
    assert hugepages.kernel_release("6.18.44-fc-v657") == (6, 18)
    assert hugepages.kernel_release("5.15.0-91-generic") == (5, 15)
    assert hugepages.kernel_release("6.1-rc3") == (6, 1)
    assert hugepages.kernel_release("weird") == (0, 0)
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(mode)) == "madvise"
    mode.write_text("nothing bracketed\n")
    assert hugepages.thp_mode(str(mode)) is None
    assert hugepages.thp_mode(str(tmp_path / "absent")) is None


maps_lines = st.lists(st.one_of(
    st.text(max_size=80),
    st.builds(lambda low, size, perms, name: f"{low:x}-{low + size:x} {perms} 00000000 "
              f"00:00 0 {name}", st.integers(0, 2**47), st.integers(0, 2**32),
              st.sampled_from(["rw-p", "r--p", "rw-s", "---p", "rwxp"]),
              st.sampled_from(["", "[heap]", "[stack]", "/lib/x.so"]))), max_size=20)


@given(maps_lines)
def test_any_maps_text_parses_to_well_formed_regions(lines: list[str]) -> None:
    regions = hugepages.anonymous_regions("\n".join(lines))
    for low, high in regions:
        assert 0 <= low < high
        span = hugepages.whole_huge_pages((low, high))
        if span is not None:
            assert low <= span[0] < span[1] <= high
            assert span[0] % hugepages.HUGE_PAGE == 0 == span[1] % hugepages.HUGE_PAGE


def test_a_failure_while_marking_never_reaches_llama_cpp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """mark_new runs inside llama.cpp's progress callback: an exception there would
    stop the load, so it is kept for the log line instead."""
    load = hugepages.HugePageLoad()

    def unreadable() -> set[hugepages.Region]:
        raise RuntimeError("maps went away")

    monkeypatch.setattr(hugepages, "current_regions", unreadable)
    load.mark_new()
    result = load.finish()
    assert result.huge_bytes == 0 and result.marked_bytes == 0
    if THP not in (None, "never"):
        assert "RuntimeError: maps went away" in result.note
    assert result.line().startswith("huge pages: 0 MiB")


THP = hugepages.thp_mode() if sys.platform == "linux" else None
