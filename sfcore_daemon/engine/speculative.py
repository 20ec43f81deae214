"""Draftless speculative decoding: a sequence's next tokens guessed from its own text.

When the last few tokens of a sequence (prompt and output so far) occurred before, the
tokens that followed them then are proposed as a draft. The step loop puts the draft
into the step beside the sequence's pending token, each row asking for logits, and the
sequence's own sampler chain samples the rows in order: a draft token is kept while it
equals what the chain drew (see rows.Rows._verify). So every token is the chain's draw
from its own row, one draw per token. With the row-invariant kernels (reproducible mode,
llama/invariant.py) a row is one token a step's to the bit, and speculation never changes
the bytes; without them a step of several rows goes through other matrix kernels, which
round otherwise (docs/performance/speculative.md, "Numerics"), and a near-tie can go the
other way.

Everything here runs on the decode thread, a few dictionary operations a step: each
n-gram is indexed once, when its continuation token arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

from sfcore_daemon.config import SpeculativeConfig
from sfcore_daemon.engine.draftgate import (
    RUN_BUCKETS,
    AcceptanceBook,
    prior_acceptance,
    run_bucket,
)

# A sequence whose drafts keep failing stops drafting for this many of its tokens at
# first, twice as many after each further failure, at most _MAX_PAUSE.
_FIRST_PAUSE = 4
_MAX_PAUSE = 256
# A match drafts this many times as far as it runs back: a long match is a copy (or a loop)
# in progress, and copies tend to go on (docs/performance/speculative.md, "Draft length").
_REACH = 2
# After a draft accepted in part, the next ones are at most this many times what was accepted
# (plus the drawn token): the match rule would retry lengths that sampled text keeps leaving.
_PARTIAL_REACH = 4
# The shortest draft worth a step: one row decodes through a faster path than several, so a
# one-token draft never pays (docs/performance/speculative.md, the step costs' table).
MIN_DRAFT = 2
# A store match runs back this many times as far as an own match: an answer that came out
# as an earlier one that long is a regenerate (docs/performance/speculative.md, the store).
_STORE_RUN = 4
# A sequence's acceptance: the prior counts as this many drafts of its own, and its own
# count decays by this each draft (text changes from copying to writing).
_PRIOR_WEIGHT = 2.0
_OWN_DECAY = 0.8


@dataclass(frozen=True, slots=True)
class DraftSettings:
    """How long drafts may be and which n-grams find them (config [speculative])."""

    draft_max: int  # tokens one draft may propose
    draft_start: int  # the shortest draft a match proposes
    ngram_max: int  # the longest n-gram matched (tried first)
    ngram_min: int  # the shortest
    store_tokens: int = 0  # finished requests' output kept for other requests' drafts
    row_multiple: int = 1  # a step's logit rows are made a multiple of this
    forced: bool = False  # constrained requests draft the text their grammar forces
    measured: bool = False  # drafts judged by the measured step costs (draftgate.py)

    @property
    def step_rows(self) -> int:
        """Draft rows one step may verify, all sequences together: each costs a row
        of logits (1 MiB with the default model's vocabulary) in llama.cpp's output
        buffer, touched the first time a step uses it."""
        return self.draft_max


def draft_settings(config: SpeculativeConfig) -> DraftSettings | None:
    """The drafts `config` asks for; None when speculation is off."""
    if config.mode == "off":
        return None
    return DraftSettings(draft_max=config.draft_max, draft_start=config.draft_start,
                         ngram_max=config.ngram_max, ngram_min=config.ngram_min,
                         store_tokens=config.store_tokens, row_multiple=config.row_multiple,
                         forced=config.forced_drafts, measured=config.policy == "measured")


class NgramStore:
    """What earlier requests generated, shared by every sequence: a request whose own
    text has no match may continue the way an earlier answer did (the same edit asked
    again, a template the model fills the same way each time).

    The tokens live in one int32 array, emptied whole when it would pass `capacity`, as
    llama.cpp's ngram-mod resets its table. They are found through a table of 4-byte
    positions, a power of two of at least twice `capacity` slots, indexed by a hash of
    the `n` tokens before each position; a slot keeps its latest position. A lookup
    compares the tokens stored before the position with the query, so a collision is a
    missed draft, never a wrong one. `nbytes` is the whole store: 12 to 20 bytes a token
    of capacity, 4 for the token and 8 to 16 for its slots (a dict of n-gram tuples
    takes about ten times that: docs/performance/speculative.md). A request sent again
    drafts from its earlier answer, so its rows are verified in other batch shapes and
    its bytes may differ: a request with a seed never drafts from it (StepLoop._begin).
    """

    __slots__ = ("n", "_capacity", "_tokens", "_used", "_table", "_shift", "generation")

    def __init__(self, n: int, capacity: int) -> None:
        import numpy as np  # here, not at import: the daemon imports numpy beside its load

        self.n = n  # the length of the n-grams it matches
        self._capacity = capacity
        # Untouched pages of both arrays are never made resident (calloc).
        self._tokens = np.zeros(capacity + 1, np.int32)  # + the last text's separator
        self._used = 0
        slots = 1 << (2 * capacity - 1).bit_length()
        self._table = np.zeros(slots, np.int32)  # 0: empty (positions start at n >= 1)
        self._shift = 64 - (slots.bit_length() - 1)
        # Counts the times it was emptied: a position from before is no longer valid.
        self.generation = 0

    @property
    def nbytes(self) -> int:
        """Its memory, at most: what its two arrays hold when every page is used."""
        return int(self._tokens.nbytes + self._table.nbytes)

    def add(self, tokens: list[int], start: int) -> None:
        """Learn `tokens[start:]`, the output of a request (with the n tokens before it
        as the first key)."""
        import numpy as np

        n = self.n
        first = max(start - n, 0)
        count = len(tokens) - first
        if not n < count < self._capacity:
            return
        if self._used + count > self._capacity:
            self.clear()
        base = self._used
        stored = self._tokens
        stored[base:base + count] = tokens[first:]
        stored[base + count] = _SEPARATOR
        self._used = base + count + 1
        # The hash of the n tokens before each position base + n .. base + count - 1.
        text = stored[base:base + count].astype(np.uint64)
        keys = np.zeros(count - n, np.uint64)
        for i, factor in enumerate(_HASH_FACTORS[:n]):
            keys += text[i:count - n + i] * np.uint64(factor)
        slots = (keys * np.uint64(_GOLDEN)) >> np.uint64(self._shift)
        positions = np.arange(base + n, base + count, dtype=np.int32)
        # The latest occurrence wins: each slot's last position in this text.
        latest, index = np.unique(slots[::-1], return_index=True)
        self._table[latest] = positions[::-1][index]

    def clear(self) -> None:
        self._used = 0
        self._table.fill(0)
        self.generation += 1

    def match(self, tokens: list[int], want: int, most_run: int,
              hint: int = 0) -> tuple[list[int], int, int]:
        """What followed the stored occurrence of the text's last n tokens that runs back
        furthest (n to `most_run` tokens: how far the stored text before it equals the
        text's end), up to `want` tokens: of the latest occurrence and of `hint`, a
        position in the store that the text has been following (0: none); that draft,
        its run and its position, or ([], 0, 0) when neither matches. The table keeps
        the latest occurrence only, and an answer that repeats its lines (code does)
        has its latest occurrence of most 4-grams elsewhere than where a regenerate of
        it stands."""
        n = self.n
        if len(tokens) < n:
            return _NO_STORE_MATCH
        key = tokens[-n:]
        hashed = 0
        for token, factor in zip(key, _HASH_FACTORS, strict=False):
            hashed += token * factor
        slot = ((hashed & _MASK64) * _GOLDEN & _MASK64) >> self._shift
        best_run, best_start = 0, 0
        for start in (int(self._table[slot]), hint):
            if (start < n or start >= self._used or start == best_start
                    or self._tokens[start] == _SEPARATOR):  # a stored text's end
                continue
            run = self._run(tokens, key, start, most_run)
            if run > best_run:
                best_run, best_start = run, start
        if not best_run:
            return _NO_STORE_MATCH
        draft: list[int] = self._tokens[best_start:min(best_start + want, self._used)].tolist()
        if _SEPARATOR in draft:
            del draft[draft.index(_SEPARATOR):]
        return draft, best_run, best_start

    def _run(self, tokens: list[int], key: list[int], start: int, most_run: int) -> int:
        """How far (n to `most_run`) the stored text before `start` equals the text's
        end, within one stored text (a separator never equals a token); 0 when its last
        n tokens are not `key`."""
        n = self.n
        stored = self._tokens
        if stored[start - n:start].tolist() != key:
            return 0
        back = min(most_run, start, len(tokens))
        before = stored[start - back:start].tolist()
        run = n
        while run < back and before[back - run - 1] == tokens[-run - 1]:
            run += 1
        return run


# One odd 64-bit factor per position of an n-gram (ngram_max is at most 16), and the
# multiplier whose high bits pick a slot (Fibonacci hashing).
_HASH_FACTORS = tuple(0x9E3779B97F4A7C15 * (2 * i + 1) % (1 << 64) | 1 for i in range(16))
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_SEPARATOR = -1  # between two requests' texts in the store: no draft runs across it
_NO_MATCH: tuple[list[int], int] = ([], 0)
_NO_STORE_MATCH: tuple[list[int], int, int] = ([], 0, 0)


class NgramDrafter:
    """One sequence's n-gram index and its adaptive draft length.

    Drafts only save steps, so a failure in here (a MemoryError indexing a long text,
    say) ends the drafts of its sequence, never the request: `failure` keeps it for the
    step loop to report, and the sequence goes on one token a step."""

    __slots__ = ("_tokens", "_indexed", "_maps", "_settings", "_limit", "_pause",
                 "_next_pause", "drafted", "accepted", "_store", "prompt_length", "failure",
                 "_hits", "_misses", "source", "run", "sampled", "_book", "_followed")

    def __init__(self, settings: DraftSettings, tokens: list[int],
                 store: NgramStore | None = None, book: AcceptanceBook | None = None) -> None:
        self._settings = settings
        self._store = store
        # How drafts fared lately across requests (draftgate.AcceptanceBook); None for a
        # request with a seed, judged by the fixed prior alone.
        self._book = book
        # By source (0: own text, 1: store) and run (a short match's miss says nothing of a
        # loop's): accepted draft tokens and drafts cut short, decaying (draftgate.py).
        self._hits = [0.0] * (2 * RUN_BUCKETS)
        self._misses = [0.0] * (2 * RUN_BUCKETS)
        self.source = 0  # where the latest proposal came from
        self.run = 0  # how far its match ran back (draftgate.prior_acceptance)
        self.sampled = False  # its request samples (temperature > 0): set by the step loop
        self.prompt_length = len(tokens)
        self._tokens = list(tokens)
        # Continuation positions below this have their n-grams in the maps.
        self._indexed = 0
        # For each n, longest first: the n tokens before a position -> that position
        # (the latest occurrence: a text that repeats itself repeats its latest form).
        self._maps: list[tuple[int, dict[tuple[int, ...], int]]] = [
            (n, {}) for n in range(settings.ngram_max, settings.ngram_min - 1, -1)]
        self._limit = settings.draft_max  # lowered by drafts accepted in part
        self._pause = 0  # tokens to go before the next draft
        self._next_pause = _FIRST_PAUSE
        self.drafted = 0
        self.accepted = 0
        self.failure: BaseException | None = None
        # The store's generation, a position in it and the text's length when the text
        # stood there: the place a regenerate follows (NgramStore.match's hint).
        self._followed = (-1, 0, 0)

    def append(self, token: int) -> None:
        """A token the sequence emitted."""
        try:
            self._tokens.append(token)
        except Exception as exc:  # drafts are an optimisation (see class)
            self.failure = exc
        if self._pause:
            self._pause -= 1

    def draft(self, room: int) -> list[int]:
        """Up to `room` tokens likely to follow the sequence's text; [] when nothing
        matches or drafting has not paid lately."""
        continuation, length = self.propose(room)
        return continuation[:length]

    def propose(self, room: int) -> tuple[list[int], int]:
        """What its best match continues with, up to `room` tokens, and how many of
        them to draft (at most `room`; 0 when nothing matches or drafting has not paid
        lately). The rest may pad a step to a cheaper size (aligned_lengths)."""
        if room < MIN_DRAFT or self._pause or self.failure is not None:
            return _NO_MATCH
        try:
            return self._propose(room)
        except Exception as exc:  # drafts are an optimisation (see class)
            self.failure = exc
            return _NO_MATCH

    def _propose(self, room: int) -> tuple[list[int], int]:
        tokens = self._tokens
        length = len(tokens)
        self._index(tokens, length)
        settings = self._settings
        limit = min(room, self._limit)
        most_run = settings.draft_max // _REACH
        store = self._store
        # A store match beats a shorter own match, and one as long that runs back less far,
        # unless it drafts less (why: docs/performance/speculative.md, the store of answers).
        stored, store_n = None, 0
        if store is not None:
            stored, store_n = self._from_store(store, tokens, room, limit,
                                               _STORE_RUN * most_run), store.n
        for n, positions in self._maps:
            if stored is not None and n < store_n:
                return stored
            if length <= n:
                continue
            start = positions.get(tuple(tokens[length - n:]))
            if start is not None:
                run = _match_length(tokens, start, n, most_run)
                want = max(min(limit, max(settings.draft_start, _REACH * run)), MIN_DRAFT)
                if stored is not None and stored[1] >= want and self.run > (
                        run if run < most_run else _match_length(tokens, start, n, self.run)):
                    return stored
                continuation = tokens[start:start + room]
                if len(continuation) < room:
                    # The match runs into the end of the text: the text is periodic
                    # with period length - start there, so the draft repeats.
                    continuation = (continuation * (room // len(continuation) + 1))[:room]
                self.source, self.run = 0, run
                return continuation, want
        return stored or _NO_MATCH

    def _from_store(self, store: NgramStore, tokens: list[int], room: int, limit: int,
                    most_run: int) -> tuple[list[int], int] | None:
        """A match in the store of earlier answers, drafted as far as a match of the
        sequence's own text that runs back as far would be."""
        generation, position, at = self._followed
        hint = position + len(tokens) - at if generation == store.generation else 0
        continuation, run, position = store.match(tokens, room, most_run, hint)
        if position:
            self._followed = (store.generation, position, len(tokens))
        if len(continuation) < MIN_DRAFT:
            return None
        want = max(min(limit, max(self._settings.draft_start, _REACH * run)), MIN_DRAFT)
        self.source, self.run = 1, run
        return continuation, min(want, len(continuation))

    def propose_after(self, forced: list[int], room: int,
                      limit: int | None = None) -> tuple[list[int], int]:
        """`propose` for the text once `forced` (tokens a grammar forces next) follows
        it: what the best match of the text's end with `forced` continues with, up to
        `room` tokens, and how many of them to draft: at most `limit` when given (those
        guesses adapt apart from this drafter's own drafts), else as its own."""
        if limit is None:
            limit = 0 if self._pause else self._limit
        if room < 1 or limit < 1 or self.failure is not None or not forced:
            return _NO_MATCH
        try:
            tokens = self._tokens
            self._index(tokens, len(tokens))
            settings = self._settings
            text = tokens + forced
            self.source = 0
            for n, positions in self._maps:
                start = positions.get(tuple(text[-n:])) if len(text) >= n else None
                if start is not None:
                    self.run = _match_length(text, start, n, settings.draft_max // _REACH)
                    want = min(room, limit, max(settings.draft_start, _REACH * self.run))
                    continuation = tokens[start:start + room]
                    return continuation, min(want, len(continuation))
        except Exception as exc:  # drafts are an optimisation (see class)
            self.failure = exc
        return _NO_MATCH

    def learn(self) -> None:
        """Give the shared store what this sequence generated (as its request ends);
        not after a failure (its text may lack tokens)."""
        store = self._store
        if store is None or self.failure is not None:
            return
        try:
            store.add(self._tokens, self.prompt_length)
        except Exception as exc:  # drafts are an optimisation (see class)
            self.failure = exc
            store.clear()  # it may hold the text without its index, or the reverse

    def acceptance(self) -> float:
        """The chance that the next draft token (from the latest proposal's source) is
        accepted, while the ones before it were."""
        source = self.source
        book = self._book
        fixed = prior_acceptance(self.run, self.sampled)
        prior = book.chance(source, self.sampled, self.run) if book is not None else fixed
        key = source * RUN_BUCKETS + run_bucket(self.run)
        # Its first draft from this source and run: other requests' drafts may lower what
        # its match promises, never raise it; a real copy's match grows as it copies.
        first = min(prior, fixed)
        # Its own drafts at this run, else at the nearest shorter one, which may only raise
        # `first`: a longer match of the same text continues no less often.
        for index in range(key, source * RUN_BUCKETS - 1, -1):
            hits, misses = self._hits[index], self._misses[index]
            if hits or misses:
                own = (hits + _PRIOR_WEIGHT * prior) / (hits + misses + _PRIOR_WEIGHT)
                return own if index == key else max(first, own)
        return first

    def verified(self, drafted: int, accepted: int) -> None:
        """How many tokens of a draft of `drafted` were accepted: adapts the next ones."""
        self.drafted += drafted
        self.accepted += accepted
        source = self.source
        if self._book is not None:
            self._book.record(source, self.sampled, self.run, drafted, accepted)
        key = source * RUN_BUCKETS + run_bucket(self.run)
        self._hits[key] = self._hits[key] * _OWN_DECAY + accepted
        self._misses[key] = self._misses[key] * _OWN_DECAY + (accepted < drafted)
        settings = self._settings
        if accepted == drafted:
            self._limit = min(self._limit * 2, settings.draft_max)
            self._next_pause = _FIRST_PAUSE
        elif accepted == 0:
            # Rows that verify nothing cost time every other sequence in the step
            # waits for: back off exponentially.
            self._limit = max(self._limit // 2, MIN_DRAFT)
            self._pause = self._next_pause
            self._next_pause = min(self._next_pause * 2, _MAX_PAUSE)
        else:
            # Each rejected row cost about a quarter of a step: stay near what was
            # accepted until drafts are accepted whole again.
            self._limit = max(_PARTIAL_REACH * (accepted + 1), MIN_DRAFT)
            self._next_pause = _FIRST_PAUSE

    def _index(self, tokens: list[int], length: int) -> None:
        # Positions [start, length) get their preceding n-grams; `length` itself has no
        # continuation yet. zip builds the keys in C: no Python loop per token.
        start = self._indexed
        if start >= length:
            return
        if start == length - 1 and start >= self._maps[0][0]:
            # One token since the last step (decoding): its n-grams by slices, without
            # zip's machinery, which costs more than the work for a single position.
            for n, positions in self._maps:
                positions[tuple(tokens[start - n:start])] = start
            self._indexed = length
            return
        for n, positions in self._maps:
            first = max(start, n)
            if first >= length:
                continue
            keys = zip(*(tokens[first - n + i:length - n + i] for i in range(n)), strict=True)
            positions.update(zip(keys, range(first, length), strict=True))
        self._indexed = length


def _match_length(tokens: list[int], start: int, n: int, most: int) -> int:
    """How far back (at least `n`, at most `most`) the text before `start` equals the
    text's end: a binary search of slice comparisons, each done in C."""
    length = len(tokens)
    low, high = n, min(most, start)
    while low < high:
        mid = (low + high + 1) // 2
        if tokens[start - mid:start] == tokens[length - mid:]:
            low = mid
        else:
            high = mid - 1
    return low


def aligned_lengths(rows: int, lengths: list[int], most: list[int], multiple: int,
                    spare: int) -> list[int]:
    """Draft lengths that make a step's logit rows a multiple of `multiple`.

    `rows`: the step's other logit rows (each generating sequence's pending token);
    `lengths`: the drafts as proposed; `most`: how long each may grow (its match's
    continuation within its room); `spare`: draft rows the step has left. llama.cpp's
    CPU kernel for the default model's output matrix (Q8_0, llamafile's tinyBLAS) takes
    logit rows four at a time and sweeps the whole matrix once more for any 1-3 left
    over, so 4k+1 rows cost about what 4k+4 do (docs/performance/speculative.md, "Rows
    come in fours"). A step 1 row past a multiple drops that row (the longest draft's
    last token, its least likely); 2 or more past, or below the first multiple, the
    longest drafts grow into the free rows. Never below 0 or past `most`; unchanged
    when neither fits.
    """
    total = rows + sum(lengths)
    over = total % multiple
    if multiple <= 1 or over == 0 or not any(lengths):
        return lengths
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    need = multiple - over
    if (2 * over >= multiple or total < multiple) and need <= spare:
        grown = list(lengths)
        for i in order:
            extra = min(need, most[i] - grown[i])
            if extra > 0:
                grown[i] += extra
                need -= extra
        if need == 0:
            return grown
    if total < multiple:
        return lengths
    cut = list(lengths)
    for i in order:
        take = min(over, cut[i])
        cut[i] -= take
        over -= take
        if over == 0:
            return cut
    return lengths
