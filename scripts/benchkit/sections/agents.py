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

Greedy (temperature 0, top_k 1), `MAX_OUTPUT` tokens a turn, tool_choice "auto" (the
same every turn: a forced choice adds a line to the tools' system text, and the prompt
would no longer start with the last turn's). First token: client-side, from writing the
request to the first event that carries output (a text delta, or a function call item).
Whole turn: to `response.completed` / `response.incomplete`. The conversation's time is
the sum of its turns' times.

    .venv/bin/python scripts/bench.py agents [--runs 3] [--llama-server PATH] [--model PATH]
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from collections.abc import Callable, Coroutine
from typing import Any

from benchkit.common import TIMEOUT_S, filler_text, log
from benchkit.context import Bench
from benchkit.daemon import Daemon
from benchkit.peers import LlamaServer
from benchkit.sections.openai import ENDPOINT, HttpChat
from benchkit.table import cell, summary

HELP = ("a 6-turn agent conversation on /v1/responses: previous_response_id, whole each turn, "
        "llama-server's /v1/responses")
DEFAULTS = {"runs": 3, "n_ctx": 8192}

Runner = Callable[[Coroutine[Any, Any, Any]], Any]

TURNS = ("What is the weather in Paris?", "And in Oslo, in fahrenheit?",
         "What is 17 plus 25?", "Which of the two cities is warmer?",
         "Add 100 and 250 for me.", "Summarise what you told me in one sentence.")
MAX_OUTPUT = 24
# About 2,000 tokens of the default model's tokenizer (checked: the table shows turn 1's
# input tokens).
SYSTEM_WORDS = 1450
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
DAEMON_CONFIG = '[openai]\nlisten = "127.0.0.1:0"\n[speculative]\nmode = "off"\n'
SIDES = ("chained", "whole", "llama-server")
LABELS = {"chained": "daemon, previous_response_id", "whole": "daemon, whole each turn",
          "llama-server": "llama-server, whole each turn"}


class HttpResponses(HttpChat):
    """HttpChat's keep-alive connection, streaming /v1/responses; `fresh`: a new
    connection for every request (llama-server closes its connection after a streamed
    reply), opened before the request's clock starts."""

    def __init__(self, host: str, port: int, fresh: bool = False) -> None:
        super().__init__(host, port)
        self.fresh = fresh

    async def respond(self, body: dict[str, Any]) -> dict[str, Any]:
        reader, started = await self._post("/v1/responses", body)
        first = ended = 0.0
        final: dict[str, Any] = {}
        async with asyncio.timeout(TIMEOUT_S):
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
                            "output": "ok: 21 C, sunny" if item["name"] == "get_weather"
                            else "ok: 42"})
    return items + results


async def conversation_chained(client: HttpResponses, instructions: str,
                               turns: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each turn: the last turn's call results and the question, after the last turn's
    response by id."""
    figures = []
    previous: str | None = None
    carried: list[dict[str, Any]] = []
    for question in turns:
        body: dict[str, Any] = {
            "instructions": instructions, "tools": TOOLS, "tool_choice": "auto",
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
                             turns: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each turn: the whole conversation so far and the question, nothing kept."""
    figures = []
    history: list[dict[str, Any]] = []
    for question in turns:
        history.append({"type": "message", "role": "user", "content": question})
        turn = await client.respond({
            "instructions": instructions, "tools": TOOLS, "tool_choice": "auto",
            "max_output_tokens": MAX_OUTPUT, "temperature": 0.0, "top_k": 1, "stream": True,
            "store": False, "input": history})
        history += next_items(turn.pop("response"))
        figures.append(turn)
    return figures


async def measure(params: dict[str, Any], runs: int, llama_server: str | None
                  ) -> dict[str, list[list[dict[str, Any]]]]:
    """Per side, per run, the conversation's turns' figures."""
    daemon = await Daemon.start(params, config=DAEMON_CONFIG)
    server: LlamaServer | None = None
    clients: list[HttpResponses] = []
    try:
        found = ENDPOINT.search(daemon.ready_status)
        if found is None:
            raise RuntimeError(f"no OpenAI address in the daemon's READY status: "
                               f"{daemon.ready_status!r}")
        chained = HttpResponses(found[1], int(found[2]))
        whole = HttpResponses(found[1], int(found[2]))
        clients += [chained, whole]
        sides: dict[str, Callable[[str, tuple[str, ...]],
                                  Coroutine[Any, Any, list[dict[str, Any]]]]] = {
            "chained": lambda text, turns: conversation_chained(chained, text, turns),
            "whole": lambda text, turns: conversation_whole(whole, text, turns),
        }
        if llama_server:
            server = await asyncio.to_thread(LlamaServer.start, llama_server, params, 1,
                                             ["--jinja"])
            peer = HttpResponses("127.0.0.1", server.port, fresh=True)
            clients.append(peer)
            sides["llama-server"] = lambda text, turns: conversation_whole(peer, text, turns)
        names = list(sides)
        system = filler_text(SYSTEM_WORDS, 7)
        samples: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
        # Run 0, unmeasured: one cold turn a side (first-touch costs).
        for index in range(runs + 1):
            shift = index % len(names)
            for number, name in enumerate(names[shift:] + names[:shift]):
                instructions = f"Conversation {index * 10 + number}. You are an agent. {system}"
                try:
                    turns = await sides[name](instructions, TURNS if index else TURNS[:1])
                except (RuntimeError, OSError, ValueError, KeyError) as error:
                    raise RuntimeError(f"{LABELS[name]}: {error!r}") from error
                if index:
                    samples[name].append(turns)
            if index:
                log(f"responses: run {index}/{runs} " + ", ".join(
                    f"{name} {sum(t['turn_ms'] for t in samples[name][-1]):.0f} ms"
                    for name in names))
        return samples
    finally:
        for client in clients:
            await client.close()
        if server is not None:
            server.stop()
        await daemon.stop()


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
        ratios = [sum(t["turn_ms"] for t in ours) / sum(t["turn_ms"] for t in theirs)
                  for ours, theirs in zip(samples["chained"], samples["llama-server"],
                                          strict=True)]
        ratio = statistics.median(ratios)
        rows.append({"target": "the whole conversation takes less time than on llama-server "
                               "(paired ratio, previous_response_id / llama-server)",
                     "measured": ratio, "met": ratio < 1.0})
    return rows


def shown(stats: dict[str, float]) -> str:
    return "-" if math.isnan(stats["median"]) else cell(stats)


def print_table(samples: dict[str, list[list[dict[str, Any]]]], header: str
                ) -> list[dict[str, Any]]:
    names = [name for name in SIDES if samples.get(name)]
    print(f"Responses API, a {len(TURNS)}-turn agent conversation (~2,000-token instructions, "
          f"2 function tools, {MAX_OUTPUT} output tokens a turn, streamed): {header}")
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
    rows = targets(samples)
    print("| target | measured | met |")
    print("|---|---|---|")
    for row in rows:
        value = "nan" if math.isnan(row["measured"]) else f"{row['measured']:.3f}"
        print(f"| {row['target']} | {value} | {'yes' if row['met'] else 'NO'} |")
    return rows


def run(bench: Bench) -> dict[str, Any]:
    """The section: measure, print the table and the targets; the JSON fields."""
    llama_server = bench.llama_server
    runs = bench.runs
    params = {**bench.params, "tokens": MAX_OUTPUT}
    log(f"[agents] daemon{' and llama-server' if llama_server else ''}, {runs} runs ...")
    samples = bench.runner(measure(params, runs, llama_server))
    rows = print_table(samples, bench.header)
    return {"samples": samples, "targets": rows}
