"""Cache marks' pins in the prompt store, without a model and on a fake clock: a pinned
state is evicted only after every unpinned one, in RAM and on disk; its pin runs out
after its TTL, and each use restarts it."""

from __future__ import annotations

import os
from pathlib import Path

from sfcore_daemon.store import disk
from sfcore_daemon.store.index import PromptIndex
from sfcore_daemon.store.statefile import state_name

STATE = 100  # bytes of each state: the budget holds three


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def index(clock: Clock) -> PromptIndex:
    return PromptIndex(None, 3 * STATE, 0, min_tokens=1, clock=clock)


def held(store: PromptIndex) -> list[list[int]]:
    return sorted(view.tokens for view in store.states(16) if view.ram)


def state() -> bytearray:
    return bytearray(STATE)


def test_a_pinned_state_is_evicted_after_every_unpinned_one() -> None:
    clock = Clock()
    store = index(clock)
    store.put([1], state(), pin_s=300)  # the oldest, pinned
    store.put([2], state())
    store.put([3], state())
    store.put([4], state())  # room for it: the least recently used unpinned goes
    assert held(store) == [[1], [3], [4]]
    store.put([5], state())
    assert held(store) == [[1], [4], [5]]
    assert store.counters.ram_evicted == 2
    # Only pinned states left to evict: the least recently used of them goes.
    store.put([6], state(), pin_s=300)
    store.put([7], state(), pin_s=300)
    store.put([8], state(), pin_s=300)
    assert held(store) == [[6], [7], [8]]


def test_a_pin_runs_out_after_its_ttl_and_each_use_restarts_it() -> None:
    clock = Clock()
    store = index(clock)
    store.put([1], state(), pin_s=300)
    store.put([2], state(), pin_s=3600)
    store.put([3], state())
    clock.now += 200
    # Read again (a restore takes its bytes): its five minutes start over.
    entry, _, _ = store.find([1, 9])
    assert entry is not None and store.take_ram(entry) is not None
    assert [(view.tokens, view.pinned_s) for view in store.states(16)] == [
        ([1], 300), ([3], 0), ([2], 3400)]
    clock.now += 299
    store.put([4], state())  # [3] is the only unpinned state
    assert held(store) == [[1], [2], [4]]
    clock.now += 2
    # [1]'s pin ran out: it is the least recently used of the unpinned states now.
    store.put([5], state())
    assert held(store) == [[2], [4], [5]]
    # A mark on a prefix already stored pins it without a copy; a shorter pin than the
    # one it has leaves the longer.
    assert store.pin([4], 300)
    assert not store.pin([4, 4], 300)
    assert store.pin([2], 300)
    pins = {tuple(view.tokens): view.pinned_s for view in store.states(16)}
    assert pins == {(2,): 3600, (4,): 300, (5,): 0}


def test_a_state_stored_again_keeps_the_longer_pin() -> None:
    clock = Clock()
    store = index(clock)
    store.put([1], state(), pin_s=300)
    store.put([1], state(), pin_s=3600)
    clock.now += 100
    store.put([1], state(), pin_s=300)  # a use: restarted, with the longer TTL
    assert [(view.tokens, view.pinned_s) for view in store.states(16)] == [([1], 3600)]
    clock.now += 3601
    store.put([2], state())
    assert [(view.tokens, view.pinned_s) for view in store.states(16)] == [([2], 0), ([1], 0)]


def test_the_disk_tier_removes_pinned_files_last(tmp_path: Path) -> None:
    own = tmp_path / ("0" * 32)
    other = tmp_path / ("1" * 32)
    own.mkdir()
    other.mkdir()
    names = [state_name([n]) for n in range(4)]
    for age, name in enumerate(names):
        path = own / name
        path.write_bytes(b"x" * 100)
        # names[0] is the least recently used; the mtime orders them.
        stamp = 1_000_000 + age
        os.utime(path, (stamp, stamp))
    (other / "old.kv").write_bytes(b"y" * 100)
    # Room for 50 more bytes within 400: two files go, another fingerprint's first,
    # then the least recently used file that is not pinned.
    room = disk.make_room(tmp_path, own, 50, 400, "", pinned={names[0], names[1]})
    assert room.fits and room.evicted == 2
    assert sorted(path.name for path in room.removed) == [names[2]]
    assert sorted(path.name for path in own.iterdir()) == sorted(
        [names[0], names[1], names[3]])
    # Only pinned files left besides the newest: pinned ones go, oldest first.
    room = disk.make_room(tmp_path, own, 250, 400, "", pinned={names[0], names[1]})
    assert room.fits
    assert [path.name for path in room.removed] == [names[3], names[0]]
