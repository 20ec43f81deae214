"""The wait queue and the decode slots.

`Scheduler` keeps one wait queue for all connections and hands the engine a generation's
job whenever a slot and room in the KV pool are free; a generation tells it when its
slot is free again (`Generation.on_released`). The queue's order, interactive requests
before background ones, is waitqueue.py's. What a generation writes is `Generation`'s
business (generation.py).
"""

from __future__ import annotations

import asyncio
import contextlib

from sfcore_daemon.core.counts import SlotUse
from sfcore_daemon.core.generation import Generation
from sfcore_daemon.core.waitqueue import WaitQueue
from sfcore_daemon.engine.crossing import Placement
from sfcore_daemon.engine.thread import Engine
from sfcore_daemon.llama.kvcache import shared_prefix

# Tokens in common with a slot's cache that make a request go to that slot even
# though most of what the slot holds would be overwritten.
_WORTHWHILE_PREFIX = 64


# How often later requests may start ahead of the queue's head while it cannot start.
_MAX_OVERTAKES = 8


class QueueFull(Exception):
    pass


class Scheduler:
    """One wait queue in front of `slots` decode slots sharing one KV pool. Event loop only.

    A request starts as soon as a slot is free and the KV pool can hold everything it
    may come to need (its prompt plus max_tokens) beside what running requests may
    need; idle slots' cached prefixes are dropped, least recently used first, to make
    that room. So a running request never fails for lack of cells, and a waiting one
    only waits. Before a prompt longer than one physical batch, idle slots' cells go
    into the prompt store whether or not room is needed (`_stored_aside`).

    Requests start in the queue's order (interactive ones first, waitqueue.py), with
    one bounded exception (`_overtake`): while a slot is free but the head cannot
    start (its reservation does not fit beside the running requests', or it must have
    the batch to itself and others run), later requests that fit start ahead of it,
    at most _MAX_OVERTAKES times while it waits.
    So one large request neither holds up the small ones behind it nor waits forever.
    A request that must have the batch to itself never overtakes.
    """

    def __init__(self, engine: Engine, max_queue: int, slots: int = 1) -> None:
        self._engine = engine
        self._max_queue = max_queue
        self.slots = slots
        self.waiting = WaitQueue()
        self.running: dict[int, Generation] = {}
        # What each idle slot holds in the KV cache, as the decode thread left it.
        self._slot_tokens: list[list[int]] = [[] for _ in range(slots)]
        self._slot_used: list[int] = [0] * slots
        # Whether each slot's tokens were left by a cache_prompt: false request.
        self._slot_unkept: list[bool] = [False] * slots
        # The prompt_cache_key of each slot's last request that gave one.
        self._slot_keys: list[str | None] = [None] * slots
        self._uses = 0
        self.slot_requests: list[int] = [0] * slots  # per-slot use, for `stats`
        self._idle = asyncio.Event()
        self._idle.set()
        self._working = asyncio.Event()  # the opposite of _idle
        # Telling the waiting their positions; a sink may re-enter (its client left).
        self._announcing = False
        self._announce_again = False

    @property
    def busy(self) -> bool:
        return bool(self.running)

    @property
    def busy_slots(self) -> int:
        return len(self.running)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def surely_full(self) -> bool:
        """Whether a request arriving now would be refused `queue_full` whatever its
        prompt: admission asks before it compiles a grammar or renders a template."""
        if self.waiting:
            return len(self.waiting) >= self._max_queue
        return self._max_queue == 0 and len(self.running) >= self.slots

    def submit(self, generation: Generation) -> None:
        if not self.waiting and self._try_start(generation):
            return
        if len(self.waiting) >= self._max_queue:
            raise QueueFull
        self.waiting.add(generation)
        self._pump()  # it may fit where the head waiting for room does not

    def abandon(self, generation: Generation) -> None:
        """The client went away: drop it from the queue, or stop it within one token."""
        generation.abandon()
        if not self._is_running(generation):
            with contextlib.suppress(ValueError):  # already dispatched or answered
                self.waiting.remove(generation)
                self._pump()  # it may have been the head that held the others back

    def cancel(self, generation: Generation) -> None:
        """The cancel op: a queued request is answered at once, a running one stops
        within one token (or one prompt batch)."""
        if self._is_running(generation):
            generation.cancel()
            return
        with contextlib.suppress(ValueError):
            self.waiting.remove(generation)
        generation.cancel_queued()
        self._pump()

    def reject_waiting(self, code: str, message: str) -> None:
        while self.waiting:
            generation = self.waiting.head
            self.waiting.remove(generation)
            generation.fail(code, message)

    def fail_all(self, code: str, message: str) -> None:
        """The decode thread is gone: every request, running or waiting, is answered
        with an error now (no running one will ever finish) and the slots are free."""
        running = list(self.running.values())
        self.running.clear()
        for generation in running:
            generation.fail(code, message)
        self.reject_waiting(code, message)
        self._idle.set()
        self._working.clear()

    def cancel_running(self) -> None:
        for generation in list(self.running.values()):
            generation.cancel()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def wait_busy(self) -> None:
        await self._working.wait()

    def slot_uses(self) -> list[SlotUse]:
        return [SlotUse(slot=slot, busy=slot in self.running,
                        requests=self.slot_requests[slot],
                        cached_tokens=0 if slot in self.running else len(self._slot_tokens[slot]))
                for slot in range(self.slots)]

    def _is_running(self, generation: Generation) -> bool:
        placement = generation.placement
        return placement is not None and self.running.get(placement.slot) is generation

    def _try_start(self, generation: Generation) -> bool:
        job = generation.job
        free = [slot for slot in range(self.slots) if slot not in self.running]
        if not free:
            return False
        slot = self._pick_slot(free, job.prompt, generation.cache_key)
        pool = self._engine.n_ctx
        held = sum(g.job.reserved_cells for g in self.running.values())
        held += job.reserved_cells
        idle = sorted((s for s in free if s != slot and self._slot_tokens[s]),
                      key=self._slot_used.__getitem__)
        held += sum(len(self._slot_tokens[s]) for s in idle)
        evict = self._stored_aside(idle, slot, job.prompt, job.cache_prompt)
        held -= sum(len(self._slot_tokens[s]) for s in evict)
        idle = [s for s in idle if s not in evict]
        # Alone and reusing nothing (cache_prompt: false), a request gets an empty cache too,
        # for a fresh daemon's bytes (docs/protocol.md, "Reproducibility and the prompt cache").
        empty = not job.cache_prompt and not self.running
        for other in idle:
            if held <= pool and not empty:
                break
            # Other sequences' cells change where llama.cpp places this one's and so the
            # order its attention sums in: only an otherwise empty cache gives cold bytes.
            evict.append(other)
            held -= len(self._slot_tokens[other])
        if held > pool:
            return False
        for other in evict:
            self._slot_tokens[other] = []
        # Fixed before the decode thread sees the job, never changed after.
        placement = generation.placement = Placement(slot, tuple(evict))
        self.running[slot] = generation
        self.slot_requests[slot] += 1
        if generation.cache_key is not None:
            self._slot_keys[slot] = generation.cache_key
        self._idle.clear()
        self._working.set()
        generation.on_released = self.release
        self._engine.submit(job, placement, generation.channel)
        return True

    def _stored_aside(self, idle: list[int], slot: int, prompt: list[int], reuse: bool
                      ) -> list[int]:
        """The idle slots to move into the prompt store before a prompt that takes more
        than one physical batch to read: attention in every one of its batches passes
        over all the pool's cells, other sequences' too, and a long prompt read beside
        another conversation's cells took up to a third longer than on its own
        (docs/performance/slots.md, "Idle caches are not free"). With a store, every
        idle slot of min_tokens or more moves, its state taken on the way out unless
        stored already: a copy of its rows costs far less than reading a batch beside
        them, and its file waits for an idle engine. Slots a cache_prompt: false request
        left (no state of theirs is kept) go too, store or not."""
        if not idle:
            return []
        reading = len(prompt) - (shared_prefix(self._slot_tokens[slot], prompt) if reuse else 0)
        if reading <= self._engine.n_ubatch:
            return []
        store = self._engine.store
        return [other for other in idle if self._slot_unkept[other] or (
            store is not None and len(self._slot_tokens[other]) >= store.min_tokens)]

    def _pick_slot(self, free: list[int], prompt: list[int], key: str | None = None) -> int:
        """The free slot whose cache shares the longest worthwhile prefix with `prompt`,
        else the one `key` (prompt_cache_key) last ran in, else the least recently used
        one (an unused one first). Between equal prefixes, the key's slot wins.

        A shared prefix is worthwhile when it is most of what the slot holds, or long
        in itself (a common system prompt): a lone BOS in common is not worth
        overwriting another conversation's cache for.
        """
        keys = self._slot_keys
        best, best_shared = -1, 0
        for slot in free:
            cached = self._slot_tokens[slot]
            shared = shared_prefix(cached, prompt)
            worthwhile = shared * 2 > len(cached) or shared >= _WORTHWHILE_PREFIX
            if worthwhile and (shared > best_shared or (
                    shared == best_shared and key is not None and keys[slot] == key)):
                best, best_shared = slot, shared
        if best >= 0:
            return best
        keyed = [slot for slot in free if key is not None and keys[slot] == key]
        if keyed:
            return max(keyed, key=self._slot_used.__getitem__)
        return min(free, key=self._slot_used.__getitem__)

    def release(self, generation: Generation) -> None:
        """`generation`'s job has ended: its slot keeps what the job left in the cache."""
        placement, end = generation.placement, generation.end
        if placement is None or self.running.get(placement.slot) is not generation:
            return
        slot = placement.slot
        del self.running[slot]
        self._slot_tokens[slot] = end.kept if end is not None else []
        self._slot_unkept[slot] = not generation.job.cache_prompt
        self._uses += 1
        self._slot_used[slot] = self._uses
        self._pump()

    def _pump(self) -> None:
        waiting = self.waiting
        while waiting:
            head = waiting.head
            if head.replied:
                waiting.remove(head)
                continue
            if self._try_start(head):
                waiting.take(head)
                continue
            self._overtake(head)
            # Starting others may have moved a background request passed too often
            # to the head: then that one is tried.
            if not waiting or waiting.head is head:
                break
        if not self.running and not waiting:
            self._idle.set()
            self._working.clear()
        self._announce()

    def _announce(self) -> None:
        """Tell each waiting request its position (a stream's client hears of a new
        one). A sink that finds its client gone abandons it here: then again."""
        if self._announcing:
            self._announce_again = True
            return
        self._announcing = True
        try:
            again = True
            while again:
                self._announce_again = False
                depth = len(self.waiting)
                for position, generation in enumerate(self.waiting, 1):
                    if self._announce_again:
                        break
                    generation.queued(position, depth)
                again = self._announce_again
        finally:
            self._announcing = False

    def _overtake(self, head: Generation) -> None:
        """The head waits for room in the KV pool (a large reservation) or for the batch
        to empty: later requests that fit now start first, at most _MAX_OVERTAKES times
        in all, so one large request neither holds up the small ones nor waits forever."""
        for generation in list(self.waiting)[1:]:
            if head.overtaken >= _MAX_OVERTAKES or len(self.running) >= self.slots:
                return
            if generation.replied:
                continue
            if self._try_start(generation):
                self.waiting.take(generation)
                head.overtaken += 1

