#!/usr/bin/env python3
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
import sys
from pathlib import Path
from typing import Any

import benchlib
import jsonschema
import uvloop
from benchlib import REPO, Daemon, decode_reply, log

TREE_PROMPT = ('A family tree as JSON.\nExample: {"name": "Ann", "children": [{"name": "Bo", '
               '"children": []}]}\nExample: ')


def cases() -> dict[str, tuple[dict[str, Any] | None, str]]:
    from tests.test_structured import (
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


async def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    from sfcore_daemon.llama import modelfile

    daemon = await Daemon.start({"model": modelfile.resolve_model_path(args.model or ""),
                                 "n_ctx": 8192, "slots": args.slots})
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
                                                           benchlib.TIMEOUT_S * 5))
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--model", help="GGUF model (default: the embedded default model)")
    parser.add_argument("--repo", help="run this checkout's daemon (default: this one)")
    parser.add_argument("--json", help="write every reply's figures to this file")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.repo:
        benchlib.REPO = Path(args.repo).resolve()
    results = uvloop.run(run(args))
    print(f"daemon: {benchlib.REPO}; {args.seeds} seeds per schema, temperature 1.0, "
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
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if valid == total else 1


if __name__ == "__main__":
    sys.exit(main())
