"""Structured output under tight budgets (issue 19): how many replies are valid documents.

10 schemas (nested objects, unbounded arrays of objects, free and minLength strings,
enums, integer bounds, a recursive $ref, `format: "json"`) x `--seeds` seeds at
temperature 1.0, each with max_tokens drawn between 1.5x and 3x the tokens of the
schema's shortest valid document. Prints, per schema and in total, the share of replies
that parse and validate, how many the daemon closed early (`truncated`), and how many
ended "length". Target: 100% valid.

`--repo DIR` runs the daemon of another checkout (e.g. the main branch, for the rate
before budget-aware completion) with the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path
from typing import Any

import jsonschema

from benchkit import common
from benchkit.common import TIMEOUT_S, decode_reply, log
from benchkit.context import Bench
from benchkit.daemon import Daemon

HELP = "structured output under tight budgets: how many replies are valid documents"
DEFAULTS = {"slots": 4}

TREE_PROMPT = ('A family tree as JSON.\nExample: {"name": "Ann", "children": [{"name": "Bo", '
               '"children": []}]}\nExample: ')


def cases() -> dict[str, tuple[dict[str, Any] | None, str]]:
    from tests.kit.structured import (
        BOUNDED,
        BUDGET_CASES,
        PERSON,
        TAGS,
        TEXT,
        few_shot,
    )
    # Recursive through $defs (the converter cannot take a root that is only a $ref).
    node = {"type": "object",
            "properties": {"name": {"type": "string"},
                           "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["name", "children"]}
    tree = {**node, "$defs": {"node": node}}
    bounded_prompt = 'Numbers as JSON.\nExample: {"level": 4, "delta": 2, "year": 1999, ' \
                     '"debt": -120}\nExample: '
    return {**BUDGET_CASES, "person": (PERSON, few_shot("person")),
            "tags": (TAGS, few_shot("tags")), "text": (TEXT, few_shot("text")),
            "bounded": (BOUNDED, bounded_prompt), "tree": (tree, TREE_PROMPT)}


async def shortest_tokens(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          schema: dict[str, Any] | None) -> int:
    from sfcore_daemon.structured.shape import free_object, shape_of
    shape = shape_of(schema) if schema is not None else free_object()
    writer.write(json.dumps({"op": "tokenize", "text": shape.shortest.decode(),
                             "add_special": False}).encode() + b"\n")
    return len(decode_reply(await reader.readline())["tokens"])


async def measure(args: argparse.Namespace, params: dict[str, Any],
                  tree: Path) -> dict[str, list[dict[str, Any]]]:
    daemon = await Daemon.start(params, tree=tree)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        reader, writer = await asyncio.open_unix_connection(daemon.socket_path,
                                                            limit=1 << 22)
        for name, (schema, prompt) in cases().items():
            shortest = await shortest_tokens(reader, writer, schema)
            rng = random.Random(name)
            requests = []
            for seed in range(args.seeds):
                budget = rng.randint(shortest * 3 // 2, shortest * 3)
                constraint = {"json_schema": schema} if schema else {"format": "json"}
                requests.append({"id": seed, "prompt": prompt, "temperature": 1.0,
                                 "seed": seed, "max_tokens": budget, "stream": False,
                                 **constraint})
            log(f"{name}: shortest document {shortest} tokens, {len(requests)} requests")
            writer.write(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
            rows = []
            for request in requests:
                done = decode_reply(await asyncio.wait_for(reader.readline(),
                                                           TIMEOUT_S * 5))
                rows.append({"budget": request["max_tokens"], "valid": _valid(done, schema),
                             "finish": done.get("finish_reason", done.get("code")),
                             "truncated": bool(done.get("truncated", False)),
                             "tokens": done.get("usage", {}).get("completion_tokens", 0),
                             "tok_s": done.get("timings", {}).get("decode_tok_s", 0.0)})
            results[name] = rows
        writer.close()
    finally:
        await daemon.stop()
    return results


def _valid(done: dict[str, Any], schema: dict[str, Any] | None) -> bool:
    if done.get("type") != "done":
        return False
    try:
        document = json.loads(done["text"])
        if schema is not None:
            jsonschema.validate(document, schema)
        return schema is not None or isinstance(document, dict)
    except (ValueError, jsonschema.ValidationError):
        return False


def add_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--repo", help="run this checkout's daemon (default: this one)")


def run(bench: Bench) -> dict[str, Any]:
    args = bench.args
    tree = Path(args.repo).resolve() if args.repo else common.REPO
    results: dict[str, Any] = bench.runner(measure(args, bench.params, tree))
    print(f"daemon: {tree}; {args.seeds} seeds per schema, temperature 1.0, "
          "max_tokens 1.5x-3x the shortest document")
    print("| schema | valid | closed early | length | mean tokens | mean decode tok/s |")
    print("|---|---|---|---|---|---|")
    total = valid = closed = cut = 0
    for name, rows in results.items():
        n = len(rows)
        ok = sum(row["valid"] for row in rows)
        early = sum(row["truncated"] for row in rows)
        lengths = sum(row["finish"] == "length" for row in rows)
        total, valid, closed, cut = total + n, valid + ok, closed + early, cut + lengths
        print(f"| {name} | {ok}/{n} | {early} | {lengths} | "
              f"{sum(row['tokens'] for row in rows) / n:.1f} | "
              f"{sum(row['tok_s'] for row in rows) / n:.1f} |")
    print(f"| all | {valid}/{total} ({100 * valid / total:.1f}%) | {closed} | {cut} | | |")
    print(f"target: 100% valid: {'met' if valid == total else 'NOT met'}")
    return results

