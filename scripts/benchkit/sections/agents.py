"""The daemon's Responses API against llama-server's on an agent's conversation: a 6-turn
conversation with a ~2,000-token system prompt and two function tools, sent through
`/v1/responses`, streamed, three ways in the same run:

- daemon, chained: each turn sends only its new items and `previous_response_id`;
- daemon, whole: each turn sends the whole conversation again (as a stateless client
  must), on the same daemon;
- llama-server's `/v1/responses` (`--llama-server PATH` or LLAMA_SERVER; without it the
  section runs without that column), whole each turn: it keeps no responses.

Each side builds its conversation as an agent does: the turn's user message, then the
model's own output items, and for each function call it made a `function_call_output`
(a fixed result) before the next user message. Every conversation is cold at its first
turn: its instructions start with a number of their own (the side and run), so no side
finds another's prefix in any cache. The sides take turns within a run (a whole
conversation each, the order rotating by run), so a drifting machine hits all alike.

Agent size: `--system-tokens N` (default ~2,000) and `--tools N` (default 2: the
conversation's own two, then as many more from a catalogue of plausible tools). The
default conversation runs on n_ctx 8192 (the daemon's, and llama-server's `-np 1 -c`);
any other size on each server's own default context (the daemon's `[model] n_ctx = 0`,
llama-server without `-c` or `-np`), unless `--n-ctx` is given.

Greedy (temperature 0, top_k 1), `MAX_OUTPUT` tokens a turn, tool_choice "auto" (the
same every turn: a forced choice adds a line to the tools' system text, and the prompt
would no longer start with the last turn's). First token: client-side, from writing the
request to the first event that carries output (a text delta, or a function call item).
Whole turn: to `response.completed` / `response.incomplete`. The conversation's time is
the sum of its turns' times.

    .venv/bin/python scripts/bench.py agents [--runs 3] [--llama-server PATH] [--model PATH]
        [--system-tokens 15000] [--tools 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from benchkit.common import TIMEOUT_S, filler_text, log
from benchkit.context import Bench
from benchkit.daemon import Daemon
from benchkit.peers import LlamaServer
from benchkit.sections.openai import ENDPOINT, HttpChat
from benchkit.table import cell, summary

HELP = ("a 6-turn agent conversation on /v1/responses: previous_response_id, whole each turn, "
        "llama-server's /v1/responses")
# n_ctx 0: the section's choice (STANDARD_N_CTX, or each server's own default).
DEFAULTS = {"runs": 3, "n_ctx": 0}
STANDARD_N_CTX = 8192

Runner = Callable[[Coroutine[Any, Any, Any]], Any]

TURNS = ("What is the weather in Paris?", "And in Oslo, in fahrenheit?",
         "What is 17 plus 25?", "Which of the two cities is warmer?",
         "Add 100 and 250 for me.", "Summarise what you told me in one sentence.")
MAX_OUTPUT = 24
# SYSTEM_WORDS make about SYSTEM_TOKENS of the default model's tokenizer (checked: the
# table shows turn 1's input tokens); other sizes scale the words.
SYSTEM_TOKENS = 2000
SYSTEM_WORDS = 1450
# A server prompt this much shorter than the daemon's is padded (server_padding); template
# text alone differs by less.
EQUAL_WITHIN = 0.02
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city now",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}},
         "required": ["city"], "additionalProperties": False}},
    {"type": "function", "name": "add", "description": "The sum of two integers",
     "parameters": {"type": "object", "properties": {
         "a": {"type": "integer"}, "b": {"type": "integer"}},
         "required": ["a", "b"], "additionalProperties": False}},
]
# More tools for --tools: (name, description, {argument: JSON Schema}), the first required.
MORE_TOOLS = (
    ("search_web", "Search the web and return the top results",
     {"query": {"type": "string", "maxLength": 200}, "limit": {"type": "integer"}}),
    ("read_file", "Read a text file from the workspace",
     {"path": {"type": "string", "maxLength": 200}, "max_bytes": {"type": "integer"}}),
    ("write_file", "Write text to a file in the workspace",
     {"path": {"type": "string", "maxLength": 200}, "text": {"type": "string"}}),
    ("list_directory", "List the entries of a workspace directory",
     {"path": {"type": "string", "maxLength": 200}, "recursive": {"type": "boolean"}}),
    ("send_email", "Send an email to one recipient",
     {"to": {"type": "string", "maxLength": 100}, "subject": {"type": "string"},
      "body": {"type": "string"}}),
    ("create_event", "Add an event to the user's calendar",
     {"title": {"type": "string", "maxLength": 100}, "date": {"type": "string"},
      "duration_minutes": {"type": "integer"}}),
    ("list_events", "The user's calendar events between two dates",
     {"start": {"type": "string"}, "end": {"type": "string"}}),
    ("convert_currency", "Convert an amount between two currencies",
     {"amount": {"type": "number"}, "from": {"enum": ["EUR", "USD", "GBP", "NOK", "JPY"]},
      "to": {"enum": ["EUR", "USD", "GBP", "NOK", "JPY"]}}),
    ("translate", "Translate a text into another language",
     {"text": {"type": "string"}, "language": {"enum": ["en", "fr", "de", "es", "no"]}}),
    ("get_time", "The local time in a time zone",
     {"zone": {"type": "string", "maxLength": 60}}),
    ("create_ticket", "Open a ticket in the issue tracker",
     {"title": {"type": "string", "maxLength": 120}, "priority": {"enum": ["low", "high"]},
      "body": {"type": "string"}}),
    ("update_ticket", "Change a ticket's state or add a comment",
     {"id": {"type": "integer"}, "state": {"enum": ["open", "closed"]},
      "comment": {"type": "string"}}),
    ("run_query", "Run a read-only SQL query on the reporting database",
     {"sql": {"type": "string", "maxLength": 2000}, "limit": {"type": "integer"}}),
    ("get_stock_price", "The last trade price of a stock",
     {"symbol": {"type": "string", "maxLength": 10}}),
    ("set_reminder", "Remind the user of something at a time",
     {"text": {"type": "string", "maxLength": 200}, "at": {"type": "string"}}),
    ("find_contact", "Look up a contact by name",
     {"name": {"type": "string", "maxLength": 100}}),
    ("book_table", "Book a restaurant table",
     {"restaurant": {"type": "string"}, "people": {"type": "integer"},
      "time": {"type": "string"}}),
    ("get_route", "Travel time and route between two places",
     {"origin": {"type": "string"}, "destination": {"type": "string"},
      "mode": {"enum": ["car", "train", "walk", "bike"]}}),
    ("summarise_url", "Fetch a web page and summarise it",
     {"url": {"type": "string", "maxLength": 500}, "sentences": {"type": "integer"}}),
    ("resize_image", "Resize an image in the workspace",
     {"path": {"type": "string"}, "width": {"type": "integer"},
      "height": {"type": "integer"}}),
    ("play_music", "Play music by an artist or of a genre",
     {"query": {"type": "string", "maxLength": 100}, "shuffle": {"type": "boolean"}}),
    ("get_news", "Today's headlines on a topic",
     {"topic": {"type": "string", "maxLength": 60}, "count": {"type": "integer"}}),
)
DAEMON_CONFIG = '[openai]\nlisten = "127.0.0.1:0"\n[speculative]\nmode = "off"\n'
SIDES = ("chained", "whole", "llama-server")
LABELS = {"chained": "daemon, previous_response_id", "whole": "daemon, whole each turn",
          "llama-server": "llama-server, whole each turn"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system-tokens", type=int, default=SYSTEM_TOKENS,
                        help=f"agents: about this many tokens of instructions (default "
                             f"{SYSTEM_TOKENS})")
    parser.add_argument("--unequal-prompts", action="store_true",
                        help="agents: do not pad llama-server's instructions to the daemon's "
                             "prompt size where its template drops the tools")
    parser.add_argument("--tools", type=int, default=len(TOOLS),
                        help=f"agents: function tools offered (default {len(TOOLS)}, at most "
                             f"{len(TOOLS) + len(MORE_TOOLS)})")


def check(args: argparse.Namespace) -> list[str]:
    problems = []
    if not 1 <= args.tools <= len(TOOLS) + len(MORE_TOOLS):
        problems.append(f"--tools must be 1 to {len(TOOLS) + len(MORE_TOOLS)}")
    if args.system_tokens < 1:
        problems.append("--system-tokens must be at least 1")
    return problems


def tool_list(count: int) -> list[dict[str, Any]]:
    """The conversation's own tools, then MORE_TOOLS, `count` in all."""
    more = [{"type": "function", "name": name, "description": description,
             "parameters": {"type": "object", "properties": properties,
                            "required": [next(iter(properties))],
                            "additionalProperties": False}}
            for name, description, properties in MORE_TOOLS]
    return [*TOOLS, *more][:count]


class HttpResponses(HttpChat):
    """HttpChat's keep-alive connection, streaming /v1/responses; `fresh`: a new
    connection for every request (llama-server closes its connection after a streamed
    reply), opened before the request's clock starts. `bound_s`: a response's hang bound."""

    def __init__(self, host: str, port: int, fresh: bool = False,
                 bound_s: float = TIMEOUT_S) -> None:
        super().__init__(host, port)
        self.fresh = fresh
        self.bound_s = bound_s

    async def respond(self, body: dict[str, Any]) -> dict[str, Any]:
        reader, started = await self._post("/v1/responses", body)
        first = ended = 0.0
        final: dict[str, Any] = {}
        async with asyncio.timeout(self.bound_s):
            headers = await self._streamed_head(reader)
            async for now, data in self._events(reader, headers):
                event = json.loads(data)
                kind = event.get("type", "")
                if not first and (kind == "response.output_text.delta" or (
                        kind == "response.output_item.added"
                        and event["item"].get("type") == "function_call")):
                    first = now
                if kind in ("response.completed", "response.incomplete", "response.failed"):
                    final = event["response"]
                    ended = now
        await self._done_with(headers, close=self.fresh)
        if final.get("status") == "failed" or not final:
            raise RuntimeError(f"the response failed: {final.get('error')!r}")
        usage = final.get("usage") or {}
        called = any(item.get("type") == "function_call" for item in final.get("output") or ())
        return {"first_token_ms": (first - started) * 1e3 if first else math.nan,
                "called": called,
                "turn_ms": (ended - started) * 1e3,
                "input_tokens": int(usage.get("input_tokens", 0)),
                "cached_tokens": int((usage.get("input_tokens_details") or {}).get(
                    "cached_tokens", 0)),
                "response": final}


def next_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The response's output as input items, and a result for each call it made."""
    items: list[dict[str, Any]] = []
    results = []
    for item in response.get("output") or ():
        if item.get("type") == "message":
            text = "".join(part.get("text", "") for part in item.get("content") or ())
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            items.append({"type": "function_call", "call_id": item["call_id"],
                          "name": item["name"], "arguments": item["arguments"]})
            results.append({"type": "function_call_output", "call_id": item["call_id"],
                            "output": {"get_weather": "ok: 21 C, sunny",
                                       "add": "ok: 42"}.get(item["name"], "ok: done")})
    return items + results


async def conversation_chained(client: HttpResponses, instructions: str,
                               tools: list[dict[str, Any]], turns: tuple[str, ...]
                               ) -> list[dict[str, Any]]:
    """Each turn: the last turn's call results and the question, after the last turn's
    response by id."""
    figures = []
    previous: str | None = None
    carried: list[dict[str, Any]] = []
    for question in turns:
        body: dict[str, Any] = {
            "instructions": instructions, "tools": tools, "tool_choice": "auto",
            "max_output_tokens": MAX_OUTPUT, "temperature": 0.0, "top_k": 1, "stream": True,
            "input": [*carried, {"type": "message", "role": "user", "content": question}]}
        if previous is not None:
            body["previous_response_id"] = previous
        turn = await client.respond(body)
        response = turn.pop("response")
        carried = [item for item in next_items(response)
                   if item.get("type") == "function_call_output"]
        previous = response["id"]
        figures.append(turn)
    return figures


async def conversation_whole(client: HttpResponses, instructions: str,
                             tools: list[dict[str, Any]], turns: tuple[str, ...]
                             ) -> list[dict[str, Any]]:
    """Each turn: the whole conversation so far and the question, nothing kept."""
    figures = []
    history: list[dict[str, Any]] = []
    for question in turns:
        history.append({"type": "message", "role": "user", "content": question})
        turn = await client.respond({
            "instructions": instructions, "tools": tools, "tool_choice": "auto",
            "max_output_tokens": MAX_OUTPUT, "temperature": 0.0, "top_k": 1, "stream": True,
            "store": False, "input": history})
        history += next_items(turn.pop("response"))
        figures.append(turn)
    return figures


@dataclass(frozen=True)
class Shape:
    """The conversation's size: its instructions' tokens and its tools; `own`: each
    server at its own default context (llama-server without `-c` or `-np`);
    `equal_prompts`: llama-server's instructions padded to the daemon's prompt size."""

    system_tokens: int
    tools: list[dict[str, Any]]
    own: bool
    equal_prompts: bool = True

    @property
    def system_words(self) -> int:
        return max(1, round(self.system_tokens * SYSTEM_WORDS / SYSTEM_TOKENS))

    @property
    def bound_s(self) -> float:
        """A response's hang bound, longer for long instructions on a busy machine."""
        return TIMEOUT_S + self.system_tokens / 20


async def measure(params: dict[str, Any], runs: int, llama_server: str | None, shape: Shape
                  ) -> tuple[dict[str, list[list[dict[str, Any]]]], int]:
    """Per side, per run, the conversation's turns' figures; the words llama-server's
    instructions were padded with (server_padding)."""
    daemon = await Daemon.start(params, config=DAEMON_CONFIG)
    tools = shape.tools
    cold_tokens: dict[str, int] = {}  # each side's prompt tokens at its unmeasured cold turn
    server: LlamaServer | None = None
    clients: list[HttpResponses] = []
    try:
        found = ENDPOINT.search(daemon.ready_status)
        if found is None:
            raise RuntimeError(f"no OpenAI address in the daemon's READY status: "
                               f"{daemon.ready_status!r}")
        chained = HttpResponses(found[1], int(found[2]), bound_s=shape.bound_s)
        whole = HttpResponses(found[1], int(found[2]), bound_s=shape.bound_s)
        clients += [chained, whole]
        sides: dict[str, Callable[[str, tuple[str, ...]],
                                  Coroutine[Any, Any, list[dict[str, Any]]]]] = {
            "chained": lambda text, turns: conversation_chained(chained, text, tools, turns),
            "whole": lambda text, turns: conversation_whole(whole, text, tools, turns),
        }
        if llama_server:
            kv = {"llama_server_kv": "default"} if shape.own else {}
            server = await asyncio.to_thread(LlamaServer.start, llama_server,
                                             {**params, **kv}, 1, ["--jinja"])
            peer = HttpResponses("127.0.0.1", server.port, fresh=True, bound_s=shape.bound_s)
            clients.append(peer)
            sides["llama-server"] = lambda text, turns: conversation_whole(peer, text, tools,
                                                                           turns)
        names = list(sides)
        system = filler_text(shape.system_words, 7)
        samples: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
        padding = ""
        # Run 0, unmeasured: one cold turn a side (first-touch costs, and each side's prompt
        # size, which sets llama-server's padding).
        for index in range(runs + 1):
            shift = index % len(names)
            for number, name in enumerate(names[shift:] + names[:shift]):
                instructions = f"Conversation {index * 10 + number}. You are an agent. {system}"
                if name == "llama-server" and padding:
                    instructions += " " + padding
                try:
                    turns = await sides[name](instructions, TURNS if index else TURNS[:1])
                except (RuntimeError, OSError, ValueError, KeyError) as error:
                    raise RuntimeError(f"{LABELS[name]}: {error!r}") from error
                if index:
                    samples[name].append(turns)
                else:
                    cold_tokens[name] = turns[0]["input_tokens"]
            if not index and "llama-server" in cold_tokens and shape.equal_prompts:
                padding = server_padding(cold_tokens["chained"], cold_tokens["llama-server"],
                                         shape.system_words)
            if index:
                log(f"responses: run {index}/{runs} " + ", ".join(
                    f"{name} {sum(t['turn_ms'] for t in samples[name][-1]):.0f} ms"
                    for name in names))
        return samples, len(padding.split())
    finally:
        for client in clients:
            await client.close()
        if server is not None:
            server.stop()
        await daemon.stop()


def server_padding(daemon_tokens: int, server_tokens: int, system_words: int) -> str:
    """Filler that brings llama-server's cold prompt to the daemon's size where its chat
    template dropped the tools (Gemma 3's takes none under --jinja), so that both read
    as many tokens and the conversation's time compares the servers, not the prompts."""
    missing = daemon_tokens - server_tokens
    if missing <= server_tokens * EQUAL_WITHIN:
        return ""
    padding = filler_text(round(missing * system_words / server_tokens), 11)
    log(f"agents: llama-server's cold prompt is {server_tokens} tokens, the daemon's "
        f"{daemon_tokens}: {len(padding.split())} words added to llama-server's instructions")
    return padding


def per_turn(samples: list[list[dict[str, Any]]], key: str) -> list[dict[str, float]]:
    return [summary([run[turn][key] for run in samples]) for turn in range(len(TURNS))]


def text_firsts(samples: list[list[dict[str, Any]]]) -> list[dict[str, float]]:
    """Per turn, the first-token times of the runs whose turn answered with text. The
    daemon sends a function call whole once its arguments are decoded (they are held to
    the tools' grammar), so a turn that answers with a call has no event before its end:
    its time is the whole turn's, not its first token's."""
    return [summary([run[turn]["first_token_ms"] for run in samples
                     if not run[turn]["called"]] or [math.nan])
            for turn in range(len(TURNS))]


def totals(samples: list[list[dict[str, Any]]]) -> dict[str, float]:
    return summary([sum(turn["turn_ms"] for turn in run) for run in samples])


def targets(samples: dict[str, list[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    firsts = [turn["median"] for turn in text_firsts(samples["chained"])]
    measured = [value for value in firsts[1:] if not math.isnan(value)]
    worst = max(measured) / firsts[0] if measured else math.nan
    rows.append({"target": "every turn after the first: first token < 0.1 x the cold first "
                           "turn's (previous_response_id, turns answered with text; the "
                           "largest ratio)", "measured": worst, "met": worst < 0.1})
    if samples.get("llama-server"):
        ratio = versus_server(samples, "chained")
        rows.append({"target": "the whole conversation takes less time than on llama-server "
                               "(paired ratio, previous_response_id / llama-server)",
                     "measured": ratio, "met": ratio < 1.0})
    return rows


def warm_fractions(samples: list[list[dict[str, Any]]]) -> list[float]:
    """Per turn after the first: the median over runs of its first output event's time
    over the cold first turn's (a call's event comes when its arguments are decoded)."""
    fractions = []
    for turn in range(1, len(TURNS)):
        ratios = [run[turn]["first_token_ms"] / run[0]["first_token_ms"] for run in samples
                  if run[0]["first_token_ms"] > 0
                  and not math.isnan(run[turn]["first_token_ms"] / run[0]["first_token_ms"])]
        fractions.append(statistics.median(ratios) if ratios else math.nan)
    return fractions


def versus_server(samples: dict[str, list[list[dict[str, Any]]]], name: str) -> float:
    """The median over runs of the whole conversation's time, side `name` / llama-server."""
    ratios = [sum(t["turn_ms"] for t in ours) / sum(t["turn_ms"] for t in theirs)
              for ours, theirs in zip(samples[name], samples["llama-server"], strict=True)]
    return float(statistics.median(ratios))


def print_ratios(samples: dict[str, list[list[dict[str, Any]]]], names: list[str]
                 ) -> dict[str, Any]:
    """Each warm turn's first output event as a fraction of the cold turn's, per side, and
    the whole conversation's time daemon / llama-server; the same as JSON."""
    fractions = {name: warm_fractions(samples[name]) for name in names}
    print("Warm turns: the first output event (text or a function call) as a fraction of "
          "the cold first turn's, the median of the runs' ratios")
    print()
    print("| turn | " + " | ".join(LABELS[name] for name in names) + " |")
    print("|---|" + "---|" * len(names))
    for turn in range(1, len(TURNS)):
        print(f"| {turn + 1} | " + " | ".join(
            "-" if math.isnan(fractions[name][turn - 1]) else f"{fractions[name][turn - 1]:.3f}"
            for name in names) + " |")
    conversation = {}
    if "llama-server" in names:
        print()
        print("| whole conversation, daemon / llama-server (paired) | ratio |")
        print("|---|---|")
        for name in ("chained", "whole"):
            conversation[name] = versus_server(samples, name)
            print(f"| {LABELS[name]} / llama-server | {conversation[name]:.3f} |")
    print()
    return {"warm_first_fraction": fractions, "conversation_vs_llama_server": conversation}


def shown(stats: dict[str, float]) -> str:
    return "-" if math.isnan(stats["median"]) else cell(stats)


def print_table(samples: dict[str, list[list[dict[str, Any]]]], header: str, shape: Shape,
                context: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    names = [name for name in SIDES if samples.get(name)]
    print(f"Responses API, a {len(TURNS)}-turn agent conversation (~{shape.system_tokens:,}-"
          f"token instructions, {len(shape.tools)} function tools, {MAX_OUTPUT} output tokens "
          f"a turn, streamed; {context}): {header}")
    print()
    print("First token, ms, of the runs whose turn answered with text (calls: the runs "
          "whose turn answered with a function call, of each side's runs)")
    print()
    print("| turn | " + " | ".join(f"{LABELS[name]}: first token | calls" for name in names)
          + " | input tokens (chained) | of them cached: chained | whole |")
    print("|---|" + "---|" * (2 * len(names) + 3))
    firsts = {name: text_firsts(samples[name]) for name in names}
    inputs = per_turn(samples["chained"], "input_tokens")
    cached = {name: per_turn(samples[name], "cached_tokens") for name in ("chained", "whole")}
    for turn in range(len(TURNS)):
        print(f"| {turn + 1} | " + " | ".join(
            f"{shown(firsts[name][turn])} | "
            f"{sum(run[turn]['called'] for run in samples[name])}" for name in names)
              + f" | {inputs[turn]['median']:.0f} | {cached['chained'][turn]['median']:.0f} "
              f"| {cached['whole'][turn]['median']:.0f} |")
    print("| whole conversation, ms | " + " | ".join(f"{cell(totals(samples[name]))} |"
                                                    for name in names) + " | | |")
    print()
    cold = print_cold(samples, names)
    ratios = print_ratios(samples, names)
    rows = targets(samples)
    print("| target | measured | met |")
    print("|---|---|---|")
    for row in rows:
        value = "nan" if math.isnan(row["measured"]) else f"{row['measured']:.3f}"
        print(f"| {row['target']} | {value} | {'yes' if row['met'] else 'NO'} |")
    return rows, {**ratios, "cold_turn": cold}


def cold_first_ms(turn: dict[str, Any]) -> float:
    """The cold turn's first output event, or its end when it answered with a call."""
    first = float(turn["first_token_ms"])
    return float(turn["turn_ms"]) if math.isnan(first) else first


def print_cold(samples: dict[str, list[list[dict[str, Any]]]], names: list[str]
               ) -> dict[str, Any]:
    """The cold first turn per side: the prompt tokens each server read (a template that
    takes no tools, such as Gemma 3's under llama-server --jinja, drops them) and how fast
    it read them; the paired ratio of time per prompt token, daemon / llama-server."""
    print("The cold first turn: prompt tokens read, first output event, prompt tokens a "
          "second to it (medians of the runs)")
    print()
    print("| side | prompt tokens | first output, ms | prompt tokens/s |")
    print("|---|---|---|---|")
    figures: dict[str, Any] = {}
    for name in names:
        tokens = statistics.median(run[0]["input_tokens"] for run in samples[name])
        first = statistics.median(cold_first_ms(run[0]) for run in samples[name])
        rate = tokens / first * 1e3 if first > 0 else math.nan
        figures[name] = {"input_tokens": tokens, "first_ms": first, "tokens_per_s": rate}
        print(f"| {LABELS[name]} | {tokens:.0f} | {first:.1f} | {rate:.1f} |")
    print()
    if "llama-server" in names:
        for name in ("chained", "whole"):
            per_token = [(cold_first_ms(ours[0]) / max(1, ours[0]["input_tokens"]))
                         / (cold_first_ms(theirs[0]) / max(1, theirs[0]["input_tokens"]))
                         for ours, theirs in zip(samples[name], samples["llama-server"],
                                                 strict=True)]
            figures[name]["per_token_vs_llama_server"] = statistics.median(per_token)
        print("| cold turn, time per prompt token, daemon / llama-server (paired) | ratio |")
        print("|---|---|")
        for name in ("chained", "whole"):
            print(f"| {LABELS[name]} / llama-server | "
                  f"{figures[name]['per_token_vs_llama_server']:.3f} |")
        print()
    return figures


def run(bench: Bench) -> dict[str, Any]:
    """The section: measure, print the table and the targets; the JSON fields."""
    llama_server = bench.llama_server
    runs = bench.runs
    args = bench.args
    standard = (args.system_tokens, args.tools) == (SYSTEM_TOKENS, len(TOOLS))
    n_ctx = args.n_ctx or (STANDARD_N_CTX if standard else 0)
    shape = Shape(args.system_tokens, tool_list(args.tools), own=n_ctx == 0,
                  equal_prompts=not args.unequal_prompts)
    context = ("each server's own default context" if shape.own
               else f"n_ctx {n_ctx}, llama-server -np 1 -c {n_ctx}")
    params = {**bench.params, "tokens": MAX_OUTPUT, "n_ctx": n_ctx}
    log(f"[agents] daemon{' and llama-server' if llama_server else ''}, {runs} runs, "
        f"~{shape.system_tokens} instruction tokens, {len(shape.tools)} tools, {context} ...")
    samples, padded_words = bench.runner(measure(params, runs, llama_server, shape))
    if padded_words:
        context += (f"; llama-server's template dropped the tools, so its instructions have "
                    f"{padded_words} more words of filler")
    rows, ratios = print_table(samples, bench.header, shape, context)
    return {"samples": samples, "targets": rows, "system_tokens": shape.system_tokens,
            "tools": len(shape.tools), "n_ctx": n_ctx, "server_padding_words": padded_words,
            **ratios}
