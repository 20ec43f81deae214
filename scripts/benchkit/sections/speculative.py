"""The speculative-decoding section of scripts/bench.py (`scripts/bench.py speculative`).

Workloads, each request greedy unless said otherwise, `--tokens` tokens, their prompts
from the prompt corpus (benchkit/corpus, `--corpus-split`, by default its held-out half):

- edit: code, prose or JSON in the prompt, asked for again with an edit (a rename, a
  typo fixed, a key renamed...), so most of the answer can copy the prompt (what editors
  and agents send all day); the corpus's four edit kinds in turn;
- free: a raw opening (prose, code, a story) continued (a small model repeats itself, so
  n-grams pay there);
- sampled: temperature 0.8 on a chat question, with nothing to copy (drafting must not
  cost);
- edit x4: four different edit requests at once, aggregate tokens/s.

`--corpus-split builtin` sends the bench's own few prompts instead, as before the corpus:
one Python module with a function renamed, FREE_STARTS and stories about SAMPLED_TOPICS.

Sides, all up together, measured one right after the other in each run (the order
rotates by run): the daemon with speculation (requests as sent) and without it
(`"speculative": false`), each its own process, so both have seen the same requests and
hold the same cells when their first tokens are timed; llama-server (`--llama-server
PATH` or LLAMA_SERVER) plain and with each `--spec-type ngram-*`, each its own process
with `-np 4`. No edit request is made twice in a sitting while the split has edit prompts
left (each side sees the same ones; a built-in edit prompt renames a function to a name of
its own), nor a free or sampled one while the split has them (built-in: up to `--runs 4`,
16 of each), so no side drafts the answer it gave the same request before.

Single-client rates are the generation rate each server reports for itself (the daemon:
`timings.decode_tok_s`, first to last token; llama-server: `timings.predicted_per_second`),
a run's figure the median of SINGLE_PROMPTS requests with prompts of their own;
edit x4 is completion tokens over the wall-clock time from the first send to the last
reply, seen by the client. Acceptance = accepted / drafted tokens. The targets compare
two sides request by request (`paired`), and each row's llama-server target is the mode
the daemon leads least; the ratio of the table's medians is printed beside each.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchkit import corpus
from benchkit.common import TIMEOUT_S, chat_turn_renderer, log, run_together
from benchkit.context import Bench
from benchkit.daemon import Daemon
from benchkit.peers import LlamaServer
from benchkit.table import summary

HELP = "speculation on and off against llama-server plain and ngram-*: edit, free, sampled"

SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
EDIT_CLIENTS = 4
# Single-client requests per workload, side and run, each with a prompt of its own: a run's
# figure is their median. Which text a greedy request writes moves with the kernels its rows
# go through (docs/performance.md, Numerics), so one prompt a run measured the text more
# than the server: the same drafter made 78 and 151 tok/s on two edit prompts of one sitting.
SINGLE_PROMPTS = 3

MODULE = '''import json
import os
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def load_items(path):
    with open(path) as handle:
        data = json.load(handle)
    return [Item(**entry) for entry in data]


def total_price(items):
    return sum(item.price * item.quantity for item in items)


def cheapest(items):
    return min(items, key=lambda item: item.price)


def save_items(path, items):
    with open(path, "w") as handle:
        json.dump([item.__dict__ for item in items], handle, indent=2)
'''
# The edit workload's renames: variant v renames FUNCTIONS[v % 4] to the (v // 4)th name of
# its list (a digit appended past the lists' end), so every variant is a request no other
# variant made. A server that keeps n-grams across requests (llama-server's ngram-mod
# does) would otherwise draft the answer it gave the same request before: that measures
# recall of a repeated request, not drafting from the text.
FUNCTIONS = ("total_price", "cheapest", "load_items", "save_items")
NEW_NAMES = {
    "total_price": ("order_total", "sum_prices", "grand_total", "total_cost", "price_sum",
                    "compute_total", "basket_total", "items_total", "total_value",
                    "overall_price", "cart_total", "full_price"),
    "cheapest": ("lowest_priced", "find_cheapest", "min_price_item", "least_expensive",
                 "cheapest_item", "lowest_price", "bargain", "pick_cheapest", "min_item",
                 "best_deal", "lowest_cost_item", "cheapest_entry"),
    "load_items": ("read_items", "items_from_file", "parse_items", "load_inventory",
                   "fetch_items", "read_inventory", "load_entries", "import_items",
                   "open_items", "items_from_json", "load_products", "get_items"),
    "save_items": ("write_items", "items_to_file", "dump_items", "store_items",
                   "save_inventory", "write_inventory", "export_items", "persist_items",
                   "save_entries", "items_to_json", "save_products", "put_items"),
}
FREE_STARTS = ["The history of the city of", "The river that runs through the valley",
               "In the year 1850, the small town of", "The old lighthouse keeper",
               "Scientists have long wondered why", "The recipe for a perfect loaf",
               "Every morning, the market square", "The first computers were",
               "Deep in the forest there", "The rules of the game are",
               "On the coast of Norway", "The museum's newest exhibit",
               "The bridge across the harbour", "Long before the railway came",
               "The village school had", "At the edge of the desert"]
SAMPLED_TOPICS = ["a fox who learns to sing", "the last train of the night", "a lost kite",
                  "a robot gardener", "a storm at sea", "a village baker", "a clockmaker",
                  "two rival chess players", "a hidden staircase", "a winter festival",
                  "an astronaut's first day", "a talking river", "a lighthouse cat",
                  "a forgotten library", "a balloon race", "a night at the observatory"]
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


Turn = Callable[[str], str]  # a user turn as raw prompt text (common.chat_turn_renderer)


def rename(variant: int) -> tuple[str, str]:
    """The function edit prompt `variant` renames, and its new name: a pair of its own
    for every variant."""
    old = FUNCTIONS[variant % len(FUNCTIONS)]
    names = NEW_NAMES[old]
    lap, index = divmod(variant // len(FUNCTIONS), len(names))
    return old, names[index] + (str(lap + 1) if lap else "")


def builtin_edit(variant: int) -> str:
    old, new = rename(variant)
    return (f"Here is a Python module:\n```python\n{MODULE}```\nRewrite this module with "
            f"the function `{old}` renamed to `{new}`. Output the whole module.")


def edit_prompt(variant: int, turn: Turn) -> str:
    """The built-in edit prompt `variant` as a chat turn (spec-replay's edit prompts)."""
    return turn(builtin_edit(variant))


class Texts:
    """The workloads' texts of variant v, the built-in ones or a corpus split's, and what
    a sitting drew: edit v takes the v // 4-th prompt of edit kind v % 4 (corpus.EDIT_KINDS),
    free v the v-th `free` opening, sampled v the v-th `chat` question, each list taken
    from its start again past its end."""

    def __init__(self, split: str) -> None:
        self.split = split
        self.drawn: dict[str, set[str]] = {"edit": set(), "free": set(), "sampled": set()}
        self.draws = dict.fromkeys(self.drawn, 0)
        self.kinds = {} if split == "builtin" else corpus.texts_by_kind(split)
        empty = [kind for kind in (*corpus.EDIT_KINDS, "free", "chat") if split != "builtin"
                 and not self.kinds[kind]]
        if empty:
            raise ValueError(f"the corpus's {split} split has no {', '.join(empty)} prompts")

    def _draw(self, workload: str, text: str) -> str:
        self.drawn[workload].add(text)
        self.draws[workload] += 1
        return text

    def edit(self, variant: int) -> str:
        if self.split == "builtin":
            return self._draw("edit", builtin_edit(variant))
        texts = self.kinds[corpus.EDIT_KINDS[variant % len(corpus.EDIT_KINDS)]]
        return self._draw("edit", texts[variant // len(corpus.EDIT_KINDS) % len(texts)])

    def free(self, variant: int) -> str:
        texts = FREE_STARTS if self.split == "builtin" else self.kinds["free"]
        return self._draw("free", texts[variant % len(texts)])

    def sampled(self, variant: int) -> str:
        if self.split == "builtin":
            topic = SAMPLED_TOPICS[variant % len(SAMPLED_TOPICS)]
            return self._draw("sampled", f"Write a short story about {topic}.")
        texts = self.kinds["chat"]
        return self._draw("sampled", texts[variant % len(texts)])

    def describe(self) -> str:
        """Where the sitting's prompts came from, and how many of each it drew."""
        drawn = ", ".join(f"{len(texts)} {workload}" for workload, texts in self.drawn.items())
        again = sum(self.draws.values()) - sum(len(texts) for texts in self.drawn.values())
        repeated = f"; {again} requests repeated an earlier prompt" if again else ""
        if self.split == "builtin":
            return f"built-in prompts: drew {drawn}{repeated}"
        edit_kinds = sum(len(self.kinds[kind]) for kind in corpus.EDIT_KINDS)
        return (f"corpus split {self.split}: drew {drawn} of its {edit_kinds} edit "
                f"({', '.join(corpus.EDIT_KINDS)}), {len(self.kinds['free'])} free and "
                f"{len(self.kinds['chat'])} chat prompts{repeated}")


def workloads(variant: int, turn: Turn,
              texts: Texts | None = None) -> dict[str, tuple[str, dict[str, Any]]]:
    """The requests of one variant, in the order sent (`texts`: by default the built-in
    ones). regenerate: the variant's edit prompt sent again (a user's "regenerate"),
    after the free and sampled requests. free is a raw opening, the others chat turns."""
    texts = texts or Texts("builtin")
    edit = turn(texts.edit(variant))
    return {
        "edit": (edit, {"temperature": 0.0}),
        "free": (texts.free(variant), {"temperature": 0.0}),
        "sampled": (turn(texts.sampled(variant)), {**SAMPLED, "seed": variant}),
        "regenerate": (edit, {"temperature": 0.0}),
    }


# --- the two kinds of server ---------------------------------------------------------------


class DaemonSide:
    def __init__(self, path: str, speculative: bool) -> None:
        self.path, self.speculative = path, speculative

    def generate(self, prompt: str, tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
        request = {"prompt": prompt, "max_tokens": tokens, "stream": False,
                   "speculative": self.speculative, **sampling}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT_S)
            sock.connect(self.path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(sock.makefile("rb").readline())
        if reply.get("type") != "done":
            raise RuntimeError(f"daemon answered {reply}")
        usage, timings = reply["usage"], reply["timings"]
        return {"tokens": usage["completion_tokens"], "tok_s": timings["decode_tok_s"],
                "first_token_ms": timings["first_token_ms"],
                "drafted": usage["drafted_tokens"], "accepted": usage["accepted_tokens"]}


class ServerSide:
    def __init__(self, server: LlamaServer) -> None:
        self.server = server

    def generate(self, prompt: str, tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": tokens, "stream": False, **sampling}
        if sampling.get("temperature", 0.0) == 0.0:
            body["top_k"] = 1
        status, reply = self.server.call("POST", "/completion", body)
        if status != 200:
            raise RuntimeError(f"llama-server answered {status}: {reply}")
        timings = reply.get("timings", {})
        return {"tokens": int(reply["tokens_predicted"]),
                "tok_s": float(timings.get("predicted_per_second", float("nan"))),
                "first_token_ms": float(timings.get("prompt_ms", float("nan"))),
                "drafted": int(timings.get("draft_n", 0)),
                "accepted": int(timings.get("draft_n_accepted", 0))}


def aggregate(side: DaemonSide | ServerSide, prompts: list[str], tokens: int) -> float:
    """Completion tokens/s of len(prompts) greedy requests sent at once."""
    def client(index: int) -> tuple[dict[str, Any], float]:
        return (side.generate(prompts[index], tokens, {"temperature": 0.0}),
                time.perf_counter())

    results, started = run_together(len(prompts), client)
    total = sum(reply["tokens"] for reply, _ in results)
    return float(total / (max(at for _, at in results) - started))


# First-token samples per run and daemon side, sent in pairs. One cold prompt's first token
# moves by 15% from request to request on the 2-vCPU machine; with 12 samples a side the
# ratio of the two medians passed and failed a 5% bound in turns with no code change (0.971,
# 1.089, 0.980, 1.082 in four sittings), so: 10 pairs a run (30 with --runs 3), and the
# median of their ratios.
FIRST_TOKEN_PAIRS = 10


def first_token_pairs(sides: dict[str, DaemonSide | ServerSide], first_variant: int,
                      figures: dict[str, dict[str, Any]], turn: Turn, texts: Texts) -> None:
    """Cold edit prompts of one token, to the daemon with and without speculation in
    pairs, one right after the other (on, off, then off, on, ...): the two processes have
    had the same requests, so they hold the same cells, and a pair's two requests meet
    the same state of a drifting machine. The samples of both sides are in pair order."""
    pair = ("daemon", "daemon, speculation off")
    samples: dict[str, list[float]] = {name: [] for name in pair}
    for index in range(FIRST_TOKEN_PAIRS):
        prompt = turn(texts.edit(first_variant + index))
        for name in (pair if index % 2 == 0 else pair[::-1]):
            reply = sides[name].generate(prompt, 1, {"temperature": 0.0,
                                                     "cache_prompt": False})
            samples[name].append(reply["first_token_ms"])
    for name in pair:
        figures[name]["first token samples"] = samples[name]


# --- the section ---------------------------------------------------------------------------


def measure_sides(params: dict[str, Any], daemon_paths: tuple[str, str], runs: int,
                  llama_server: str | None,
                  texts: Texts | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every run's figures, per side. `daemon_paths`: the sockets of the daemon that gets
    the requests with speculation and of the one that gets them without; `texts`: the
    prompts (by default the built-in ones)."""
    texts = texts or Texts("builtin")
    sides: dict[str, DaemonSide | ServerSide] = {
        "daemon": DaemonSide(daemon_paths[0], True), "daemon, speculation off":
        DaemonSide(daemon_paths[1], False)}
    servers: list[LlamaServer] = []
    turn = chat_turn_renderer(params["model"])
    try:
        if llama_server:
            for spec in (None, *SPEC_TYPES):
                extra = ["--spec-type", spec] if spec else []
                server = LlamaServer.start(llama_server, params, EDIT_CLIENTS, extra)
                servers.append(server)
                sides["llama-server" + (f" {spec}" if spec else "")] = ServerSide(server)
        tokens = params["tokens"]
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        names = list(sides)
        # Edit variants: the single-client ones first, then edit x4's, then the first-token
        # probes', each request made once in the sitting. Index 0 warms every side up
        # (first-touch costs, prompt caches) unmeasured.
        x4_first = (runs + 1) * SINGLE_PROMPTS
        probes_first = x4_first + (runs + 1) * EDIT_CLIENTS
        for index in range(runs + 1):
            order = names[index % len(names):] + names[:index % len(names)]
            edit_prompts = [turn(texts.edit(x4_first + index * EDIT_CLIENTS + i))
                            for i in range(EDIT_CLIENTS)]
            figures: dict[str, dict[str, Any]] = {name: {} for name in names}
            replies: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for variant in range(index * SINGLE_PROMPTS, (index + 1) * SINGLE_PROMPTS):
                for workload, (prompt, sampling) in workloads(variant, turn, texts).items():
                    for name in order:
                        # Cold prompts for every side: edit prompts share their openings
                        # (built-in: the same module), which a slot would otherwise cache.
                        replies.setdefault((name, workload), []).append(sides[name].generate(
                            prompt, tokens, {**sampling, "cache_prompt": False}))
            for (name, workload), answers in replies.items():
                figures[name][workload] = statistics.median(reply["tok_s"] for reply in answers)
                figures[name][f"{workload} requests"] = [reply["tok_s"] for reply in answers]
                drafted = sum(reply["drafted"] for reply in answers)
                figures[name][f"{workload} acceptance"] = (
                    sum(reply["accepted"] for reply in answers) / drafted if drafted else None)
                if workload == "edit":
                    figures[name]["first token ms"] = statistics.median(
                        reply["first_token_ms"] for reply in answers)
            for name in order:
                try:
                    figures[name]["edit x4"] = aggregate(sides[name], edit_prompts, tokens)
                except RuntimeError as error:
                    raise RuntimeError(f"{name}, edit x4: {error}") from error
            first_token_pairs(sides, probes_first + index * FIRST_TOKEN_PAIRS, figures, turn,
                              texts)
            if index == 0:
                continue
            for name in names:
                samples[name].append(figures[name])
            log(f"speculative: run {index}/{runs} " + ", ".join(
                f"{name} {figures[name]['edit']:.1f}" for name in names))
        return samples
    finally:
        for server in servers:
            server.stop()


ROWS = ("edit", "free", "sampled", "regenerate", "edit x4")


def medians(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    result: dict[str, dict[str, float]] = {}
    for side, runs in samples.items():
        result[side] = {}
        for key in (*ROWS, "first token ms", *(f"{row} acceptance" for row in ROWS[:4])):
            values = [run[key] for run in runs if run.get(key) is not None]
            result[side][key] = statistics.median(values) if values else float("nan")
    return result


def print_table(samples: dict[str, list[dict[str, Any]]], header: str) -> list[dict[str, Any]]:
    """The table and the targets; returns the targets."""
    stats = medians(samples)
    print(f"Speculative decoding: {header}")
    print()
    print("| side | edit tok/s | free tok/s | sampled tok/s | regenerate tok/s | "
          "edit x4 aggregate tok/s | acceptance edit / free / sampled / regenerate | "
          "edit first token ms |")
    print("|---|---|---|---|---|---|---|---|")
    for side, runs in samples.items():
        cells = [f"{summary([run[row] for run in runs])['median']:.1f} "
                 f"({min(run[row] for run in runs):.1f}-{max(run[row] for run in runs):.1f})"
                 for row in ROWS]
        acceptance = " / ".join(
            "-" if stats[side][f"{row} acceptance"] != stats[side][f"{row} acceptance"]
            else f"{stats[side][f'{row} acceptance']:.2f}" for row in ROWS[:4])
        print(f"| {side} | " + " | ".join(cells) + f" | {acceptance} | "
              f"{stats[side]['first token ms']:.1f} |")
    print()
    daemon, off = stats["daemon"], stats["daemon, speculation off"]
    spec_sides = [side for side in stats if side.startswith("llama-server ")]
    targets: list[dict[str, Any]] = []

    def target(label: str, row: str, other: str, bound: float, measured: float) -> None:
        targets.append({"target": label, "measured": round(measured, 3),
                        "of medians": round(stats["daemon"][row] / stats[other][row], 3),
                        "met": measured >= bound})

    # Issue 49's bounds, on any model: at least the best llama-server mode on every
    # single-client row that copies (and at four clients), and speculation never more
    # than 3% below the same daemon without it. Each measured as the median of the
    # request-by-request ratios (`paired`), and against llama-server's mode
    # that the daemon leads least: the strictest reading of "the best mode".
    if spec_sides:
        for row in ("edit", "free", "regenerate", "edit x4"):
            led = {other: paired(samples, row, "daemon", other) for other in spec_sides}
            side = min(led, key=led.__getitem__)
            target(f"{row} >= 1.0 x best llama-server ngram ({side})", row, side, 1.0,
                   led[side])
    for row in ROWS:
        target(f"{row}: speculation on >= 0.97 x off", row, "daemon, speculation off", 0.97,
               paired(samples, row, "daemon", "daemon, speculation off"))
    first = {side: [value for run in samples[side]
                    for value in run.get("first token samples", [])]
             for side in ("daemon", "daemon, speculation off")}
    if all(first.values()):
        on, off_side = first["daemon"], first["daemon, speculation off"]
        ratio = statistics.median(a / b for a, b in zip(on, off_side, strict=True))
        of_medians = statistics.median(on) / statistics.median(off_side)
        print(f"First token, {len(first['daemon'])} pairs of cold one-token edit prompts, "
              "one to each daemon side right after the other (median, min-max): " + ", ".join(
                  f"{side} {statistics.median(values):.1f} ({min(values):.1f}-"
                  f"{max(values):.1f}) ms" for side, values in first.items())
              + f"; median of the pairs' ratios {ratio:.3f}, ratio of the medians "
              f"{of_medians:.3f}")
        print()
    else:
        ratio = daemon["first token ms"] / off["first token ms"]
    targets.append({"target": "first token with speculation <= 1.05 x without",
                    "measured": round(ratio, 3), "met": ratio <= 1.05})
    print("| target | median of paired ratios | ratio of medians | met |")
    print("|---|---|---|---|")
    for line in targets:
        of_medians = f"{line['of medians']:.3f}" if "of medians" in line else "-"
        print(f"| {line['target']} | {line['measured']:.3f} | {of_medians} | "
              f"{'yes' if line['met'] else 'NO'} |")
    return targets


# How a target compares two sides: each request with the same request to the other
# side, sent within seconds of it (all sides take a variant's request before the next
# variant), and the median of those ratios. One side's per-run medians spread by up to
# 12% in a sitting on SmolLM2 (free, speculation off: 164.2-185.0 tok/s), more than the
# bounds they were checked against, while the machine's drift over a minute is shared
# by a pair.
def paired(samples: dict[str, list[dict[str, Any]]], row: str, side: str,
           other: str) -> float:
    """The median over the sitting's requests of `side`'s rate / `other`'s on the same
    request (edit x4: on the same run's four requests)."""
    key = f"{row} requests"
    ratios = [float(a) / float(b)
              for mine, theirs in zip(samples[side], samples[other], strict=True)
              for a, b in zip(mine.get(key, [mine[row]]), theirs.get(key, [theirs[row]]),
                              strict=True)]
    return float(statistics.median(ratios))


def run(bench: Bench) -> dict[str, Any]:
    """The sides against two daemons started here: one takes the requests with
    speculation, the other the same requests without it."""
    params, runs, llama_server = bench.params, bench.runs, bench.llama_server
    texts = Texts(bench.args.corpus_split)

    async def measure() -> dict[str, list[dict[str, Any]]]:
        # One event loop for the daemons' whole life: a process belongs to the loop that
        # started it. The section itself is synchronous (threads, blocking sockets).
        with_speculation = await Daemon.start(params)
        try:
            without = await Daemon.start(params)
            try:
                return await asyncio.to_thread(
                    measure_sides, params,
                    (with_speculation.socket_path, without.socket_path), runs, llama_server,
                    texts)
            finally:
                await without.stop()
        finally:
            await with_speculation.stop()

    samples = bench.runner(measure())
    spec_header = f"{bench.header}; llama-server -np {EDIT_CLIENTS}; {texts.describe()}"
    targets = print_table(samples, spec_header)
    return {"samples": samples, "medians": medians(samples), "targets": targets,
            "prompts": {"split": texts.split,
                        **{workload: len(drawn) for workload, drawn in texts.drawn.items()}}}
