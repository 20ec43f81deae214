"""Huge pages under the model's weights and the context's buffers.

A decode step reads every weight once: 92 MB for SmolLM2-135M Q4_1, 250 MB for the
default model. In 4 KiB pages that is 23,000-60,000 pages a step, far more than the
CPU's TLB holds, so each step walks page tables for most of them. In 2 MiB pages
llama.cpp's own one-row step takes less time (docs/performance/huge-pages.md).

llama.cpp asks for none. A mapped model file (`use_mmap = true`) lies in the page
cache in 4 KiB pages; read into memory (`use_mmap = false`, the daemon's default) it
lies in anonymous memory, which Linux backs with huge pages only where a process asks
(transparent_hugepage "madvise", most distributions' default) or everywhere
("always"). So the anonymous regions that a load makes are marked MADV_HUGEPAGE as
soon as llama.cpp has made them: the weights, written after that, fault in as 2 MiB
pages; what was written before (the KV cache, cleared as the context is made) is
collapsed with MADV_COLLAPSE (Linux 6.1). Where the kernel refuses that, the mark
stays and khugepaged collapses the rest in the background.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from dataclasses import dataclass

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP_MODE_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"

Region = tuple[int, int]


@dataclass(frozen=True, slots=True)
class HugePages:
    """What one load got: bytes marked MADV_HUGEPAGE, bytes in 2 MiB pages when it
    ended (the rest of the marked bytes not yet written), and why not more."""

    marked_bytes: int = 0
    huge_bytes: int = 0
    # Empty where nothing was refused; else the reason, for the log.
    note: str = ""

    def line(self) -> str:
        text = (f"huge pages: {self.huge_bytes / 2**20:.0f} MiB of the model's and "
                f"context's memory in 2 MiB pages ({self.marked_bytes / 2**20:.0f} MiB marked)")
        return f"{text}; {self.note}" if self.note else text


def anonymous_regions(maps: str) -> set[Region]:
    """The private writable anonymous regions (the heap included) of a
    /proc/PID/maps text; lines that are not such a region, or not a maps line, are
    skipped."""
    regions: set[Region] = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3:4] != "p":
            continue
        name = fields[5].strip() if len(fields) == 6 else ""
        if name not in ("", "[heap]"):
            continue
        start, dash, end = fields[0].partition("-")
        try:
            low, high = int(start, 16), int(end, 16)
        except ValueError:
            continue
        if dash and low < high:
            regions.add((low, high))
    return regions


def current_regions() -> set[Region]:
    """This process's anonymous regions now; empty where /proc is not there."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            return anonymous_regions(maps.read())
    except OSError:
        return set()


def anon_huge_bytes() -> int:
    """This process's anonymous memory in huge pages (smaps_rollup's AnonHugePages)."""
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii", errors="replace") as rollup:
            for line in rollup:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def whole_huge_pages(region: Region) -> Region | None:
    """The part of `region` that whole 2 MiB pages cover, or None."""
    low = -(-region[0] // HUGE_PAGE) * HUGE_PAGE
    high = region[1] // HUGE_PAGE * HUGE_PAGE
    return (low, high) if low < high else None


def kernel_release(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of a Linux release string ("6.18.44-fc"), (0, 0) if unreadable."""
    parts = (release if release is not None else os.uname().release).split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1][:3] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def thp_mode(path: str = THP_MODE_PATH) -> str | None:
    """The bracketed word of transparent_hugepage/enabled ("always", "madvise",
    "never"), or None where the kernel has none."""
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


class HugePageLoad:
    """Huge pages for one model load: `mark_new` when llama.cpp has made the weights'
    buffers but not yet written them (its first progress callback), so that the
    weights fault in as 2 MiB pages with nothing to copy; `finish` when the context is
    made, which marks its buffers too and collapses what was written in 4 KiB pages
    before its mark (the KV cache, cleared as it is made)."""

    def __init__(self) -> None:
        self._enabled = sys.platform == "linux" and thp_mode() not in (None, "never")
        # MADV_COLLAPSE is Linux 6.1's; before it the advice is an EINVAL like a page
        # not yet written, so it is not tried.
        self._collapse = self._enabled and kernel_release() >= (6, 1)
        self._before = current_regions() if self._enabled else set()
        self._huge_before = anon_huge_bytes() if self._enabled else 0
        self._spans: list[Region] = []
        self._refused: set[int] = set()
        self._libc: ctypes.CDLL | None = None
        self._failure = ""

    def mark_new(self) -> None:
        """Mark the anonymous regions made since the last mark (or the start). Never
        raises: it runs inside llama.cpp's progress callback, where an exception would
        read as "stop the load"."""
        if not self._enabled:
            return
        try:
            self._mark_new()
        except Exception as exc:  # huge pages are an optimisation; the load goes on
            self._enabled = False
            self._failure = f"not used ({type(exc).__name__}: {exc})"

    def _mark_new(self) -> None:
        now = current_regions()
        fresh, self._before = now - self._before, now
        if self._libc is None:
            self._libc = ctypes.CDLL(None, use_errno=True)
            self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for region in fresh:
            span = whole_huge_pages(region)
            if span is None:
                continue
            if self._libc.madvise(span[0], span[1] - span[0], MADV_HUGEPAGE) == 0:
                self._spans.append(span)
            else:
                self._refused.add(ctypes.get_errno())

    def finish(self) -> HugePages:
        """Mark what the load made since the last mark, collapse every marked span."""
        self.mark_new()
        if self._failure:
            return HugePages(note=self._failure)
        libc = self._libc
        if not self._enabled or libc is None:
            mode = thp_mode() if sys.platform == "linux" else None
            return HugePages(note="not Linux" if sys.platform != "linux" else
                             f"transparent huge pages are {mode or 'not in this kernel'}")
        marked = sum(high - low for low, high in self._spans)
        for low, high in self._spans if self._collapse else ():
            # Page by page: one page the kernel cannot collapse (a buffer's unused tail)
            # would stop a whole-span call there; a page already huge costs one call.
            for page in range(low, high, HUGE_PAGE):
                if libc.madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
                    continue
                code = ctypes.get_errno()
                if code == errno.EINVAL:
                    # A page never written: it faults in huge when it is.
                    continue
                self._refused.add(code)
                if code in (errno.EPERM, errno.ENOSYS):
                    # A sandbox that forbids it: khugepaged collapses the marked spans.
                    return self._result(marked)
                # EAGAIN/ENOMEM, no free huge page for this one now: the next may do.
        return self._result(marked)

    def _result(self, marked: int) -> HugePages:
        note = ""
        if self._refused:
            refused = ", ".join(sorted(errno.errorcode.get(code, str(code))
                                       for code in self._refused))
            note = f"the rest left to khugepaged (refused: {refused})"
        elif not self._collapse:
            note = "the rest left to khugepaged (no MADV_COLLAPSE before Linux 6.1)"
        # The kernel's count, not the calls': a collapse of a range never written
        # succeeds with nothing to collapse.
        return HugePages(marked, max(anon_huge_bytes() - self._huge_before, 0), note)
