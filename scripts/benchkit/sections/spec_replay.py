"""The daemon's drafter against llama.cpp's ngram-mod on the same texts, replayed.

Live, each server writes its own greedy text: from 4 rows a step llama.cpp's kernels round
otherwise (docs/performance.md, Numerics), so the daemon and llama-server answer the same
edit prompt with texts that part after a few dozen tokens, and a run's rate says as much
about the text as about the drafter. This script takes the texts out of it, with llama.cpp
driven directly in one process:

1. The cost of one `llama_decode` of R rows, every row asking for logits, for R = 1 .. 65
   (median of 5, the sizes in a shuffled order each round).
2. Greedy references, one token a step, for the speculative section's edit and free
   prompts (from the prompt corpus's `--corpus-split`, by default its held-out half),
   256 tokens each.
3. Each reference replayed step by step: a drafter proposes, the draft is accepted up to
   the first token that differs from the reference, the step costs what step 1 measured
   for its rows. Drafters: the daemon's as its defaults run it (each draft cut by the
   measured gate, draftgate.py, to the length that pays by these step costs and its
   chance; the store of earlier answers on), the daemon's taking every draft (with and
   without rounding a step's rows to a multiple of 4), and llama.cpp's ngram-mod as its
   `common/ngram-mod.cpp` and `common/speculative.cpp` build it (a table of 24-gram ->
   next token shared by all requests and kept across them, drafts of 48 to 64 tokens),
   fed the requests in the bench's order (with an edit prompt of the bench's edit x4 row
   after each edit and free one, learned from but not timed); the daemon's taking
   every draft with the store of earlier answers (`store_tokens`), fed the same way;
   and llama.cpp's ngram-simple (`common_ngram_simple_draft`: the last 12 tokens' latest
   earlier place in the text, and up to 48 tokens after it), which keeps nothing.
   Replayed tok/s = 256 / the summed step costs. Beside each median: the median of the
   prompts' ratios to ngram-mod on the same reference, and the worst free prompt's.

    .venv/bin/python scripts/bench.py spec-replay [--prompts 12] [--model PATH]
        [--corpus-split held-out|tuning|all|builtin]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import numpy

from benchkit.common import chat_turn_renderer
from benchkit.context import Bench
from benchkit.sections.spec_rows import Context
from benchkit.sections.speculative import FREE_STARTS, Texts
from sfcore_daemon.engine.draftgate import AcceptanceBook, StepCosts, best_length, expected_tokens
from sfcore_daemon.engine.speculative import (
    MIN_DRAFT,
    DraftSettings,
    NgramDrafter,
    NgramStore,
    aligned_lengths,
)

HELP = "the daemon's drafter against llama.cpp's ngram-mod on the same texts, replayed"

TOKENS = 256
MAX_ROWS = 65  # the daemon's draft_max (64) + its pending token; ngram-mod's n_max too
# llama.cpp's defaults for --spec-type ngram-mod (common/common.h).
MOD_MATCH, MOD_MAX, MOD_MIN = 24, 64, 48
# ngram-mod adds the n-grams of a growing text in chunks, and empties its table after 5
# drafts in a row with less than a quarter accepted (common/speculative.cpp).
MOD_CHUNK = 32
MOD_LOW, MOD_LOW_STREAK = 0.25, 5
# llama.cpp's defaults for --spec-type ngram-simple (common/common.h: size_n, size_m).
SIMPLE_MATCH, SIMPLE_MAX = 12, 48
DAEMON = DraftSettings(draft_max=64, draft_start=4, ngram_max=4, ngram_min=2)
STORE_TOKENS = 65536  # for the side with [speculative] store_tokens
# The daemon's defaults ([speculative] in server_config.toml): the gated side.
GATED = DraftSettings(draft_max=64, draft_start=4, ngram_max=4, ngram_min=2,
                      store_tokens=262144, row_multiple=4, measured=True)


def step_costs(context: Context, prompt: list[int], rounds: int = 5) -> dict[int, float]:
    times: dict[int, list[float]] = {rows: [] for rows in range(1, MAX_ROWS + 1)}
    order = random.Random(0)
    for _ in range(rounds):
        for rows in order.sample(list(times), len(times)):
            context.fresh(prompt)
            started = time.perf_counter()
            context.decode(list(range(1000, 1000 + rows)), len(prompt), True)
            times[rows].append(time.perf_counter() - started)
    return {rows: statistics.median(values) for rows, values in times.items()}


def greedy(context: Context, prompt: list[int]) -> list[int]:
    """One token a step, as a request without speculation."""
    def top(row: int) -> int:
        logits = numpy.ctypeslib.as_array(context.row_pointer(row), shape=(context.n_vocab,))
        return int(logits.argmax())

    context.fresh(prompt)
    tokens = [top(-1)]
    while len(tokens) < TOKENS:
        context.decode([tokens[-1]], len(prompt) + len(tokens) - 1, True)
        tokens.append(top(0))
    return tokens


def accepted_length(draft: list[int], output: list[int], done: int) -> int:
    """How many of `draft`'s tokens the reference has next, after its first `done`."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == output[done + accepted]:
        accepted += 1
    return accepted


def replay(prompt: list[int], output: list[int], cost: dict[int, float], multiple: int,
           store: NgramStore | None = None, *, gate: tuple[AcceptanceBook, StepCosts] | None = None
           ) -> float:
    """The daemon's drafter (one request, the step loop's rules) over a reference; with
    `store`, also drafting from (and then adding to) earlier requests' outputs. With
    `gate` (the acceptance book shared across requests and the step costs), as the
    daemon's defaults run it: each draft cut to the length that pays by the costs and its
    chance, rounded to `multiple` rows only where that pays; without, every draft taken
    and rounded."""
    settings = DAEMON if gate is None else GATED
    drafter = NgramDrafter(settings, prompt, store, gate[0] if gate is not None else None)
    drafter.append(output[0])
    done, seconds = 1, 0.0
    while done < len(output):
        share = settings.draft_max
        continuation, length = drafter.propose(min(len(output) - done - 1, share + multiple - 1))
        length = draft_length(drafter, continuation, min(length, share), share,
                              multiple=multiple, costs=gate[1] if gate is not None else None)
        draft = continuation[:length]
        accepted = accepted_length(draft, output, done)
        seconds += cost[1 + len(draft)]
        if draft:
            drafter.verified(len(draft), accepted)
        for token in output[done:done + accepted + 1]:
            drafter.append(token)
        done += accepted + 1
    drafter.learn()
    return len(output) / seconds


def draft_length(drafter: NgramDrafter, continuation: list[int], length: int, share: int, *,
                 multiple: int, costs: StepCosts | None) -> int:
    """The proposed draft's length as the step loop settles it (drafting.DraftPlan): with
    `costs`, first cut to the length that pays most (draftgate.best_length)."""
    if length < MIN_DRAFT:
        return 0
    chance = drafter.acceptance() if costs is not None else 1.0
    if costs is not None:
        length, _ = best_length(costs, 1, 1.0, chance, longest=length, shortest=MIN_DRAFT,
                                multiple=multiple)
        if not length:
            return 0
    aligned = aligned_lengths(1, [length], [len(continuation)], multiple, share - length)[0]
    if costs is None or (1 + expected_tokens(chance, aligned)) / costs.cost(1 + aligned) >= (
            1 + expected_tokens(chance, length)) / costs.cost(1 + length):
        return aligned
    return length


class NgramMod:
    """llama.cpp's ngram-mod: the last MOD_MATCH tokens -> the token that followed them,
    one table for every request (its hash table, without collisions)."""

    def __init__(self) -> None:
        self.table: dict[tuple[int, ...], int] = {}
        self.low = 0  # drafts in a row with less than MOD_LOW accepted

    def learn(self, tokens: list[int], start: int, end: int) -> None:
        for index in range(start, end):
            self.table[tuple(tokens[index:index + MOD_MATCH])] = tokens[index + MOD_MATCH]

    def replay(self, prompt: list[int], output: list[int], cost: dict[int, float]) -> float:
        text = list(prompt)
        if len(text) > MOD_MATCH:
            self.learn(text, 0, len(text) - MOD_MATCH)
        learned = max(len(text) - MOD_MATCH, 0)
        text.append(output[0])
        done, seconds = 1, 0.0
        while done < len(output):
            # llama-server's "prompt" is the text without the token just sampled.
            known = len(text) - 1
            if learned + MOD_CHUNK < known:
                self.learn(text, learned, known - MOD_MATCH)
                learned = known - MOD_MATCH
            room = min(MOD_MAX, len(output) - done - 1)
            draft: list[int] = []
            window = text[-MOD_MATCH:]
            while len(draft) < room:
                token = self.table.get(tuple(window[len(window) - MOD_MATCH:]))
                if token is None:
                    break
                draft.append(token)
                window.append(token)
            if len(draft) < min(MOD_MIN, room):
                draft = []
            accepted = accepted_length(draft, output, done)
            seconds += cost[1 + len(draft)]
            if draft:
                self.low = self.low + 1 if accepted < MOD_LOW * len(draft) else 0
                if self.low >= MOD_LOW_STREAK:
                    self.table.clear()
                    self.low = learned = 0
            text.extend(output[done:done + accepted + 1])
            done += accepted + 1
        return len(output) / seconds


def simple_draft(tokens: list[int], sampled: int) -> list[int]:
    """llama.cpp's ngram-simple (common/ngram-map.cpp, common_ngram_simple_draft): the
    latest earlier place where the last SIMPLE_MATCH tokens (`sampled` the last of them)
    occurred in `tokens`, and the up to SIMPLE_MAX tokens after it; none where fewer than
    SIMPLE_MATCH follow it."""
    length = len(tokens)
    if length <= SIMPLE_MATCH + SIMPLE_MAX + 1:
        return []
    pattern = [*tokens[length - SIMPLE_MATCH + 1:], sampled]
    for start in range(length - SIMPLE_MATCH - 1, 0, -1):
        if tokens[start:start + SIMPLE_MATCH] == pattern:
            copy = min(SIMPLE_MAX, length - (start + SIMPLE_MATCH))
            if copy < SIMPLE_MATCH:
                return []
            return tokens[start + SIMPLE_MATCH:start + SIMPLE_MATCH + copy]
    return []


def simple_replay(prompt: list[int], output: list[int], cost: dict[int, float]) -> float:
    """llama-server's ngram-simple over a reference: it keeps nothing across requests."""
    text = [*prompt, output[0]]
    done, seconds = 1, 0.0
    while done < len(output):
        draft = simple_draft(text[:-1], text[-1])[:len(output) - done - 1]
        accepted = accepted_length(draft, output, done)
        seconds += cost[1 + len(draft)]
        text.extend(output[done:done + accepted + 1])
        done += accepted + 1
    return len(output) / seconds


def add_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--prompts", type=int, default=12, help="edit and free prompts each")


def run(bench: Bench) -> dict[str, Any]:
    args = bench.args
    context = Context(bench.params["model"])
    cost = step_costs(context, context.tokenize(FREE_STARTS[0]))
    texts: list[tuple[str, list[int], list[int]]] = []
    turn = chat_turn_renderer(bench.params["model"])
    texts_of = Texts(args.corpus_split)
    # The bench's order: an edit and a free prompt, then the edit prompts its edit x4 row
    # sends (replayed too, unmeasured: what the tables learn from them counts).
    for variant in range(args.prompts):
        for kind, text in (("edit", turn(texts_of.edit(variant))),
                           ("free", texts_of.free(variant)),
                           ("other edit", turn(texts_of.edit(args.prompts + variant)))):
            prompt = context.tokenize(text)
            texts.append((kind, prompt, greedy(context, prompt)))
    mod = NgramMod()
    store = NgramStore(DAEMON.ngram_max, STORE_TOKENS)
    gated_store = NgramStore(GATED.ngram_max, GATED.store_tokens)
    book, costs = AcceptanceBook(), StepCosts({rows: value * 1e9 for rows, value in cost.items()},
                                              MAX_ROWS)
    gated = "daemon, its defaults (the measured gate, the store)"
    rates: dict[str, dict[str, list[float]]] = {
        side: {"edit": [], "free": []} for side in
        ("one token a step", gated, "daemon, every draft", "daemon, every draft, row_multiple 1",
         f"daemon, every draft, store_tokens {STORE_TOKENS}", "llama.cpp ngram-mod",
         "llama.cpp ngram-simple")}
    for kind, prompt, output in texts:
        if kind not in ("edit", "free"):
            replay(prompt, output, cost, 4, store)
            replay(prompt, output, cost, 4, gated_store, gate=(book, costs))
            mod.replay(prompt, output, cost)
            continue
        rates["one token a step"][kind].append(len(output) / (cost[1] * len(output)))
        rates[gated][kind].append(replay(prompt, output, cost, 4, gated_store, gate=(book, costs)))
        rates["daemon, every draft"][kind].append(replay(prompt, output, cost, 4))
        rates["daemon, every draft, row_multiple 1"][kind].append(
            replay(prompt, output, cost, 1))
        rates[f"daemon, every draft, store_tokens {STORE_TOKENS}"][kind].append(
            replay(prompt, output, cost, 4, store))
        rates["llama.cpp ngram-mod"][kind].append(mod.replay(prompt, output, cost))
        rates["llama.cpp ngram-simple"][kind].append(simple_replay(prompt, output, cost))
    print(f"Prompts: {texts_of.describe()}")
    print(f"Replayed over {args.prompts} greedy references per workload, {TOKENS} tokens, step "
          f"costs measured in this run (1 row {cost[1] * 1e3:.1f} ms, 4 rows "
          f"{cost[4] * 1e3:.1f}, 5 rows {cost[5] * 1e3:.1f}, 64 rows {cost[64] * 1e3:.1f})")
    print()
    print("| drafter | edit tok/s (median) | free tok/s (median) | edit / ngram-mod | "
          "free / ngram-mod | free: the worst prompt's ratio |")
    print("|---|---|---|---|---|---|")
    # Every token drafted and accepted, in the cheapest steps: no drafter does better.
    best = [0.0] + [float("inf")] * TOKENS
    for done in range(1, TOKENS + 1):
        best[done] = min(best[done - rows] + cost[rows]
                         for rows in range(1, min(MAX_ROWS, done) + 1))
    bound = TOKENS / best[TOKENS]
    print(f"| every token drafted and accepted (a bound) | {bound:.1f} | {bound:.1f} | - | - "
          "| - |")
    mod_rates = rates["llama.cpp ngram-mod"]
    for side, by_kind in rates.items():
        # Each prompt against ngram-mod on the same reference: the median, and the worst.
        ratios = {kind: [mine / theirs for mine, theirs in zip(by_kind[kind], mod_rates[kind],
                                                               strict=True)]
                  for kind in ("edit", "free")}
        print(f"| {side} | {statistics.median(by_kind['edit']):.1f} | "
              f"{statistics.median(by_kind['free']):.1f} | "
              f"{statistics.median(ratios['edit']):.3f} | "
              f"{statistics.median(ratios['free']):.3f} | {min(ratios['free']):.2f} |")
    simple = rates["llama.cpp ngram-simple"]
    for kind in ("edit", "free"):
        ratios_simple = [mine / theirs for mine, theirs in zip(rates[gated][kind], simple[kind],
                                                               strict=True)]
        print(f"{gated} / llama.cpp ngram-simple, {kind}: median of the prompts' ratios "
              f"{statistics.median(ratios_simple):.3f}, worst {min(ratios_simple):.2f}")
    return {"step_ms": {rows: value * 1e3 for rows, value in cost.items()}, "rates": rates}

