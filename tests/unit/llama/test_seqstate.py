"""seqstate.py: the parts of a llama.cpp sequence state and the window pad built from
them. Synthetic states for the format's edges; one real state of the real model (a
sliding-window model: Gemma 3) to show the reading matches what llama.cpp writes, and
that llama.cpp takes the pad back.

This file holds the tests that need no daemon and no model; those of llama.cpp and the
real model in-process in tests/e2e/llama/test_seqstate.py.
"""

from __future__ import annotations

import struct

import pytest

from sfcore_daemon.llama.seqstate import Part, parts, window_pad

HEAD = struct.pack("<Ii", 0x67677371, 3)


def part(cells: int, layers: int, row: int = 16, ext: int = 0, v_trans: int = 0) -> bytes:
    out = struct.pack("<II", 1, cells)
    out += (struct.pack("<iI", 7, 1) + bytes(ext) + struct.pack("<i", 3)) * cells
    out += struct.pack("<II", v_trans, layers)
    for index in range(2 * layers):
        out += struct.pack("<iQ", 1, row) + bytes([index]) * (row * cells)
    return out


def test_a_two_part_state_reads_as_its_parts() -> None:
    state = HEAD + part(40, 3) + part(12, 5, row=32)
    assert parts(state) == [Part(40, 0, [(1, 16)] * 6), Part(12, 0, [(1, 32)] * 10)]


def test_cells_with_an_extension_are_read_too() -> None:
    state = HEAD + part(9, 2, ext=12) + part(4, 2, ext=12)
    found = parts(state)
    assert found is not None and [p.cells for p in found] == [9, 4]
    assert all(p.ext == 12 for p in found)


@pytest.mark.parametrize("state", [
    HEAD + part(8, 2)[:-1],                     # one byte short
    HEAD + part(8, 2) + b"\0",                  # one byte over
    HEAD + part(8, 2, v_trans=1),               # V stored transposed
    HEAD + struct.pack("<II", 2, 0),            # two streams
    HEAD[:5],
], ids=["short", "long", "v-transposed", "streams", "no-part"])
def test_what_it_does_not_know_gives_none(state: bytes) -> None:
    assert parts(state) is None
    assert window_pad(state, 10) is None


def test_the_pad_holds_the_window_layers_only_at_position_0() -> None:
    state = HEAD + part(40, 3) + part(12, 5, row=32)
    pad = window_pad(state, 100)
    assert pad is not None
    blob, window_cells = pad
    assert window_cells == 12
    data = bytes(blob)
    assert data[:8] == HEAD
    [only] = parts(data) or []
    assert only == Part(100, 0, [(1, 32)] * 10)
    cells = data[16:16 + 12 * 100]
    assert cells == struct.pack("<iIi", 0, 1, 0) * 100
    assert data[16 + 12 * 100:] == struct.pack("<II", 0, 5) + (
        struct.pack("<iQ", 1, 32) + bytes(32 * 100)) * 10  # K and V of 5 layers: zeros


def test_no_pad_for_one_part_or_none_wanted() -> None:
    assert window_pad(HEAD + part(40, 3), 10) is None  # no window layers
    assert window_pad(HEAD + part(40, 3) + part(12, 5), 0) is None
