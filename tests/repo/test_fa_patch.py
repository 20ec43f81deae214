"""scripts/llama-patches/fa-split-kv-balance.patch: its two helpers, compiled from the
patch's own text with stand-ins for ggml's types, against any mask (hypothesis).

- The split-KV parts cut the whole range into one contiguous part per thread, from 0
  to the end, and hold equal shares (to one cell) of the cells the mask shows.
- The list of a mask row's shown cells in a part is exactly its cells that the mask
  does not hide, in order.

The real kernel, with the patch built in, is tested in tests/e2e/llama/test_kv_layout.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kit import REPO

PATCH = REPO / "scripts" / "llama-patches" / "fa-split-kv-balance.patch"
HIDDEN = 0xFC00  # -INFINITY in FP16
# Shown cells' mask values: 0, -0, -1 (ALiBi-like distances), the largest finite negative.
SHOWN = (0x0000, 0x8000, 0xBC00, 0xFBFF)

STANDINS = """
#include <algorithm>
#include <cstdint>
#include <cstring>
typedef uint16_t ggml_fp16_t;
enum ggml_type { GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1 };
struct ggml_tensor { ggml_type type; int64_t ne[4]; void * data; };
"""
ENTRIES = """
extern "C" void split_bounds(const uint16_t * mask, int64_t nek1, int ith, int nth,
                             int per_head, int64_t * start, int64_t * end) {
    ggml_tensor tensor{GGML_TYPE_F16, {nek1, 1, per_head ? 2 : 1, 1}, (void *) mask};
    ggml_flash_attn_ext_split_kv_bounds(mask ? &tensor : nullptr, nek1, ith, nth, start, end);
}
extern "C" int64_t shown_cells(const uint16_t * mask, int64_t first, int64_t last,
                               int32_t * cells) {
    return ggml_flash_attn_ext_shown_cells(mask, first, last, cells);
}
"""


def _helpers_source() -> str:
    added = [line[1:] for line in PATCH.read_text().splitlines() if line.startswith("+")
             and not line.startswith("+++")]
    text = "\n".join(added)
    start = text.index("// A mask value that hides a cell")
    end = text.index("\n}\n", text.index("static void ggml_flash_attn_ext_split_kv_bounds")) + 3
    return STANDINS + text[start:end] + ENTRIES


@pytest.fixture(scope="module")
def helpers(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    folder = tmp_path_factory.mktemp("fa")
    source, library = folder / "helpers.cpp", folder / "helpers.so"
    source.write_text(_helpers_source())
    subprocess.run([compiler, "-std=c++17", "-O2", "-shared", "-fPIC", str(source), "-o",
                    str(library)], check=True, timeout=120)
    lib = ctypes.CDLL(str(library))
    size, pointer = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
    lib.split_bounds.argtypes = [ctypes.c_void_p, size, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, pointer, pointer]
    lib.shown_cells.argtypes = [ctypes.c_void_p, size, size, ctypes.POINTER(ctypes.c_int32)]
    lib.shown_cells.restype = size
    return lib


def _mask(values: list[int]) -> ctypes.Array[ctypes.c_uint16]:
    return (ctypes.c_uint16 * max(len(values), 1))(*values)


def _parts(lib: ctypes.CDLL, values: list[int] | None, nek1: int, nth: int,
           per_head: bool = False) -> list[tuple[int, int]]:
    mask = None if values is None else _mask(values)
    parts = []
    for ith in range(nth):
        start, end = ctypes.c_int64(), ctypes.c_int64()
        lib.split_bounds(mask, nek1, ith, nth, int(per_head), ctypes.byref(start),
                         ctypes.byref(end))
        parts.append((start.value, end.value))
    return parts


masks = st.lists(st.one_of(st.just(HIDDEN), st.sampled_from(SHOWN)), min_size=1, max_size=700)
runs = st.lists(st.tuples(st.booleans(), st.integers(1, 70)), min_size=1, max_size=20).map(
    lambda spans: [HIDDEN if hidden else 0 for hidden, length in spans for _ in range(length)])


@settings(max_examples=300, deadline=None)
@given(values=st.one_of(masks, runs), nth=st.integers(1, 8))
def test_the_parts_cover_the_range_and_share_the_shown_cells(
        helpers: ctypes.CDLL, values: list[int], nth: int) -> None:
    nek1 = len(values)
    parts = _parts(helpers, values, nek1, nth)
    assert parts[0][0] == 0 and parts[-1][1] == nek1
    assert all(start <= end for start, end in parts)
    assert all(parts[index][1] == parts[index + 1][0] for index in range(nth - 1))
    shown = [sum(value != HIDDEN for value in values[start:end]) for start, end in parts]
    total = sum(value != HIDDEN for value in values)
    assert shown == [total * (ith + 1) // nth - total * ith // nth for ith in range(nth)]


@settings(max_examples=300, deadline=None)
@given(values=st.one_of(masks, runs), data=st.data())
def test_the_shown_cells_are_the_cells_the_mask_does_not_hide(
        helpers: ctypes.CDLL, values: list[int], data: st.DataObject) -> None:
    first = data.draw(st.integers(0, len(values)))
    last = data.draw(st.integers(first, len(values)))
    cells = (ctypes.c_int32 * max(last - first, 1))()
    count = helpers.shown_cells(_mask(values), first, last, cells)
    assert list(cells[:count]) == [index for index in range(first, last)
                                   if values[index] != HIDDEN]


@pytest.mark.parametrize("per_head", [False, True])
def test_without_a_shared_mask_the_parts_are_equal_pieces(helpers: ctypes.CDLL,
                                                          per_head: bool) -> None:
    values = [HIDDEN] * 600 + [0] * 168
    expected = [(0, 256), (256, 512), (512, 768)]
    assert _parts(helpers, None if not per_head else values, 768, 3, per_head) == expected


def test_a_sequence_after_idle_cells_is_shared_between_the_threads(
        helpers: ctypes.CDLL) -> None:
    # One sequence's 301 cells after 350 cells of idle ones, in a 768-cell window.
    values = [HIDDEN] * 350 + [0] * 301 + [HIDDEN] * 117
    parts = _parts(helpers, values, len(values), 2)
    assert parts == [(0, 500), (500, 768)]  # 150 and 151 shown cells; unpatched 34 and 267
