"""Tool calls (issue 36): how many answers are calls that validate, daemon and llama-server.

The same tools as tests/e2e/ndjson/test_tools.py (get_weather, add) and one with a nested object
(add_event), PROMPTS user messages, `tool_choice` "required" and the named function
"add", temperatures 0 (greedy) and 1.0 (top_k 40, top_p 0.95, min_p 0.05 on both sides),
seeds 0..--seeds-1 and max_tokens 16 and 24 (tight: the shortest call of these tools
takes 15 tokens) and 128 (roomy). Every combination goes to:

- the daemon, NDJSON `chat` with `tools` and `tool_choice` (docs/protocol.md, "Tool
  calls"); calls read from the done line's `tool_calls` (arguments a JSON object);
- llama-server (`--llama-server PATH` or LLAMA_SERVER; without it the daemon only),
  `/v1/chat/completions` with `tools` and `tool_choice`, `--jinja` (it refuses tools
  without), the daemon's n_ctx and threads, `-np` = the daemon's slots (or 1), no draft;
  calls read from `message.tool_calls` (arguments JSON text).

An answer is *valid* when it ends with finish_reason "tool_calls" and every call in it
names an allowed tool (the named one, for a named choice) and has arguments that parse
and validate (jsonschema) against that tool's parameters. *Invalid/partial*: it carries
calls and one fails that, or it has none but its text starts a call (a JSON object or
array, or a `<tool_call>` marker: a call cut short). *No call*: the rest (plain text,
an error reply). Per row (side, tool_choice, temperature, max_tokens): requests, valid,
invalid/partial, no call, validity %.

    .venv/bin/python scripts/bench.py tools [--seeds 20] [--slots 4] [--llama-server PATH]
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import jsonschema

from benchkit.common import REPO, TIMEOUT_S, decode_reply, log
from benchkit.context import Bench
from benchkit.daemon import Daemon
from benchkit.peers import LlamaServer

HELP = "tool calls: how many forced calls validate, daemon and llama-server"
DEFAULTS = {"slots": 4}

Runner = Callable[[Coroutine[Any, Any, Any]], Any]

EVENT = {"type": "function", "function": {
    "name": "add_event", "description": "Put an event in the calendar",
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "when": {"type": "object", "properties": {
            "date": {"type": "string", "maxLength": 10},
            "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["date"], "additionalProperties": False}},
        "required": ["title", "when"], "additionalProperties": False}}}
PROMPTS = ("What is the weather in Paris, and what is 2 + 3?",
           "Add 17 and 25.",
           "Put lunch with Ana on 2025-03-14 at noon in my calendar.")
NAMED = "add"
CHOICES = ("required", NAMED)
TEMPERATURES = (0.0, 1.0)
MAX_TOKENS = (16, 24, 128)
SAMPLED = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}
# Requests in flight on the daemon's connection at once: under its [server] max_queue.
WINDOW = 32
VALID_NOTE = ("valid: finish_reason \"tool_calls\" and every call names an allowed tool "
              "(the named one for a named choice) with arguments that validate against its "
              "parameters (jsonschema); invalid/partial: calls that do not, or text that "
              "starts a call; no call: text only, or an error")


@functools.cache
def tools() -> list[dict[str, Any]]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.kit.tools import ADD, WEATHER
    return [WEATHER, ADD, EVENT]


def choice_label(choice: str) -> str:
    return choice if choice == "required" else f"function {choice}"


def choice_field(choice: str) -> Any:
    return choice if choice == "required" else {"type": "function",
                                                "function": {"name": choice}}


def cases(seeds: int) -> list[dict[str, Any]]:
    """Every row's requests: (choice, temperature, max_tokens) x prompts x seeds."""
    rows = []
    for choice in CHOICES:
        for temperature in TEMPERATURES:
            for max_tokens in MAX_TOKENS:
                sampling = {"temperature": 0.0, "top_k": 1} if temperature == 0 else {
                    "temperature": temperature, **SAMPLED}
                requests = [{"messages": [{"role": "user", "content": prompt}],
                             "tools": tools(), "tool_choice": choice_field(choice),
                             "max_tokens": max_tokens, "seed": seed, "stream": False,
                             **sampling}
                            for prompt in PROMPTS for seed in range(seeds)]
                rows.append({"choice": choice, "temperature": temperature,
                             "max_tokens": max_tokens, "requests": requests})
    return rows


def classify(calls: list[dict[str, Any]] | None, finish: str | None, text: str,
             choice: str, parameters: dict[str, dict[str, Any]]) -> str:
    """"valid", "invalid" (invalid or partial) or "none" (no call); calls in OpenAI's
    shape, `arguments` a JSON object or JSON text."""
    if not calls:
        started = text.lstrip()
        return "invalid" if started[:1] in ("{", "[") or "<tool_call>" in text else "none"
    allowed = set(parameters) if choice == "required" else {choice}
    if finish != "tool_calls":
        return "invalid"
    for call in calls:
        function = call.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments")
        if name not in allowed:
            return "invalid"
        try:
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            jsonschema.validate(arguments, parameters[name])
        except (ValueError, jsonschema.ValidationError):
            return "invalid"
    return "valid"


def parameters_of(offered: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {tool["function"]["name"]: tool["function"]["parameters"] for tool in offered}


async def daemon_side(path: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 22)
    parameters = parameters_of(tools())
    results = []
    try:
        for row in rows:
            requests = [{"op": "chat", "id": index, **request}
                        for index, request in enumerate(row["requests"])]
            outcomes: list[str] = []
            errors: list[str] = []
            for start in range(0, len(requests), WINDOW):
                window = requests[start:start + WINDOW]
                writer.write(b"".join(json.dumps(r).encode() + b"\n" for r in window))
                for _ in window:
                    done = decode_reply(await asyncio.wait_for(reader.readline(),
                                                               TIMEOUT_S * 5))
                    if done.get("type") != "done":
                        errors.append(f"{done.get('code')}: {done.get('message')}")
                        outcomes.append("none")
                        continue
                    outcomes.append(classify(done.get("tool_calls"),
                                             done.get("finish_reason"), done.get("text", ""),
                                             row["choice"], parameters))
            results.append(tally("daemon", row, outcomes, errors))
            log(f"tools: {row_label(results[-1])}: {results[-1]['valid']}/"
                f"{results[-1]['requests']} valid")
    finally:
        writer.close()
    return results


def llama_server_side(binary: str, params: dict[str, Any],
                      rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The rows' counts and what llama-server made of the tools: its template's caps
    (GET /props) and the prompt it renders for the first request (POST /apply-template)."""
    from concurrent.futures import ThreadPoolExecutor


    slots = params.get("slots") or 1
    server = LlamaServer.start(binary, params, slots, ["--jinja"])
    parameters = parameters_of(tools())
    results = []
    try:
        _, props = server.call("GET", "/props", None)
        caps = props.get("chat_template_caps", {})
        _, rendered = server.call("POST", "/apply-template", rows[0]["requests"][0])
        prompt = str(rendered.get("prompt", rendered))
        names = [tool["function"]["name"] for tool in tools()]
        note = (f"llama-server template caps: supports_tools={caps.get('supports_tools')}, "
                f"supports_tool_calls={caps.get('supports_tool_calls')}; the tools "
                f"{'appear' if any(n in prompt for n in names) else 'do NOT appear'} in its "
                f"rendered prompt: {prompt!r}")
        log(f"tools: {note}")

        def one(request: dict[str, Any], choice: str) -> tuple[str, str | None]:
            status, reply = server.call("POST", "/v1/chat/completions", request)
            if status != 200:
                return "none", f"HTTP {status}: {json.dumps(reply)[:300]}"
            choice_ = (reply.get("choices") or [{}])[0]
            message = choice_.get("message") or {}
            return classify(message.get("tool_calls"), choice_.get("finish_reason"),
                            message.get("content") or "", choice, parameters), None

        with ThreadPoolExecutor(slots) as pool:
            for row in rows:
                answers = list(pool.map(lambda r, c=row["choice"]: one(r, c),
                                        row["requests"]))
                results.append(tally("llama-server", row, [a for a, _ in answers],
                                     [e for _, e in answers if e is not None]))
                log(f"tools: {row_label(results[-1])}: {results[-1]['valid']}/"
                    f"{results[-1]['requests']} valid")
    finally:
        server.stop()
    return results, note


def tally(side: str, row: dict[str, Any], outcomes: list[str],
          errors: list[str]) -> dict[str, Any]:
    if errors:
        log(f"tools: {side}: {len(errors)} error replies, the first: {errors[0]}")
    return {"side": side, "tool_choice": row["choice"], "temperature": row["temperature"],
            "max_tokens": row["max_tokens"], "requests": len(outcomes),
            "valid": outcomes.count("valid"), "invalid": outcomes.count("invalid"),
            "no_call": outcomes.count("none"), "errors": len(errors),
            "first_error": errors[0] if errors else None}


def row_label(row: dict[str, Any]) -> str:
    return (f"{row['side']}, {choice_label(row['tool_choice'])}, temperature "
            f"{row['temperature']:g}, max_tokens {row['max_tokens']}")


async def measure(params: dict[str, Any], seeds: int,
                  llama_server: str | None) -> dict[str, Any]:
    rows = cases(seeds)
    daemon = await Daemon.start(params, config='[speculative]\nmode = "off"\n')
    try:
        results = await daemon_side(daemon.socket_path, rows)
    finally:
        await daemon.stop()
    note = ""
    if llama_server:
        served, note = await asyncio.to_thread(llama_server_side, llama_server, params, rows)
        results += served
    return {"rows": results, "llama_server_note": note}


def print_table(section: dict[str, Any], header: str) -> None:
    print(f"Tool calls: {header}; {section['seeds']} seeds x {len(PROMPTS)} prompts per row")
    print(VALID_NOTE)
    if section["llama_server_note"]:
        print(section["llama_server_note"])
    print()
    print("| side | tool_choice | temperature | max_tokens | requests | valid calls | "
          "invalid/partial | no call | validity % |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in section["rows"]:
        share = 100 * row["valid"] / row["requests"] if row["requests"] else 0.0
        print(f"| {row['side']} | {choice_label(row['tool_choice'])} | {row['temperature']:g} "
              f"| {row['max_tokens']} | {row['requests']} | {row['valid']} | {row['invalid']} "
              f"| {row['no_call']} | {share:.1f} |")


def header_of(params: dict[str, Any]) -> str:
    slots = params.get("slots")
    header = (f"model {Path(params['model']).name}, n_ctx {params['n_ctx']}, threads "
              f"{params['n_threads']}/{params['n_threads_batch']} (decode/batch), daemon "
              f"slots {slots or 'default'}, llama-server -np {slots or 1} --jinja, "
              f"speculation off")
    if os.environ.get("OMP_WAIT_POLICY"):
        header += f", OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} (both sides)"
    return header


def run_rows(params: dict[str, Any], seeds: int, llama_server: str | None, *,
             runner: Runner) -> dict[str, Any]:
    """The section: measure, print the table; the JSON fields."""
    if llama_server and not (os.path.isfile(llama_server) and os.access(llama_server, os.X_OK)):
        raise SystemExit(f"llama-server {llama_server} is not an executable file")
    log(f"[tools] daemon{' and llama-server' if llama_server else ''}, {seeds} seeds ...")
    section = runner(measure(params, seeds, llama_server))
    section["seeds"] = seeds
    section["header"] = header_of(params)
    print_table(section, section["header"])
    return section


def run(bench: Bench) -> dict[str, Any]:
    return run_rows(bench.params, bench.args.seeds, bench.llama_server, runner=bench.runner)
