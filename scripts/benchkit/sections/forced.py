"""Structured output against free text (issue 38): the tokens a schema forces, drafted.

Four schemas (flat, nested, enums, arrays of objects), each with a one-shot completion
prompt: a task line, an example text and its document (as json.dumps writes it), then a
new text; the model's natural continuation, free or constrained, is its document. And
two prompts more where the free text is that document too (enums2: two examples, so the
model classifies instead of copying the one example's labels; arrays2: an example of
the answer's shape, so the free text does not go on listing attendees in a loop); and
bench.py's structured prompt (orders: JSON lines after two examples, a near-copy). Two
daemons up together, the default config and the same with `[speculative] forced_drafts =
false`; both speculate (the default). Per schema, a one-token request on each daemon
first, so that every measured request finds its prompt in the slot's cache. For each
schema and sampling (greedy; temperature 0.7 with seeds 7, 8 and 9, each seed its own
document), twice a run, each daemon first once:

- **forced**: `generate` with `json_schema` on the default daemon;
- **no forced**: the same request on the other daemon (its n-gram drafts only);
- **free**: the same prompt without a schema on the default daemon, max_tokens the
  document's tokens (the same prompt's free decode);
- **free on the other daemon**: the same, to show unconstrained requests unchanged;
- **llama-server** (`--llama-server PATH` or LLAMA_SERVER; `-np 1`, the daemon's n_ctx and
  threads, its defaults otherwise: no drafts): the constrained request on `/completion`
  with the same `json_schema` (its own conversion to a grammar), its own
  `timings.predicted_per_second`.

Per schema and sampling: decode tok/s of each (the median of its requests), the paired
ratios forced/free and forced/no-forced (the median over the pairs, each pair the same
seed back to back), the first token's time and the whole request's ratio forced/free
(sending to last token), the forced tokens drafted and accepted, whether every document
validates (jsonschema), and in how many pairs the forced daemon's text equals the
other's byte for byte.

    .venv/bin/python scripts/bench.py forced [--runs 3] [--schemas flat,enums]
        [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections.abc import Callable, Coroutine
from typing import Any

import jsonschema

from benchkit.common import log
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream
from benchkit.peers import LlamaServer
from benchkit.sections.structured import STRUCTURED_PROMPT, STRUCTURED_SCHEMA
from benchkit.table import paired_ratio

HELP = "constrained decode on four schemas with and without forced drafts"
DEFAULTS = {"runs": 3, "n_ctx": 4096}

Runner = Callable[[Coroutine[Any, Any, Any]], Any]

def _prompt(task: str, example_text: str, example: dict[str, Any], text: str) -> str:
    """A one-shot completion prompt: the model's natural continuation, free or
    constrained, is the document for `text` (written as json.dumps writes the example)."""
    return (f"{task}\n\nText: {example_text}\nJSON:\n{json.dumps(example)}\n\n"
            f"Text: {text}\nJSON:\n")


_FLAT = {
    "type": "object",
    "properties": {
        "full_name": {"type": "string"},
        "job_title": {"type": "string"},
        "company_name": {"type": "string"},
        "email_address": {"type": "string"},
        "phone_number": {"type": "string"},
        "years_of_experience": {"type": "integer"},
        "works_remotely": {"type": "boolean"},
    },
    "required": ["full_name", "job_title", "company_name", "email_address", "phone_number",
                 "years_of_experience", "works_remotely"],
}
_NESTED = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {
            "first_name": {"type": "string"}, "last_name": {"type": "string"}},
            "required": ["first_name", "last_name"]},
        "shipping_address": {"type": "object", "properties": {
            "street_address": {"type": "string"}, "postal_code": {"type": "string"},
            "city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["street_address", "postal_code", "city", "country"]},
        "payment": {"type": "object", "properties": {
            "amount": {"type": "number"}, "currency_code": {"type": "string"},
            "payment_method": {"type": "string"}},
            "required": ["amount", "currency_code", "payment_method"]},
        "delivery_options": {"type": "object", "properties": {
            "express_shipping": {"type": "boolean"}, "gift_wrapping": {"type": "boolean"}},
            "required": ["express_shipping", "gift_wrapping"]},
    },
    "required": ["customer", "shipping_address", "payment", "delivery_options"],
}
_ENUMS = {
    "type": "object",
    "properties": {
        "category": {"enum": ["account_access", "billing_and_payments", "bug_report",
                              "feature_request", "shipping_and_delivery"]},
        "priority": {"enum": ["low", "medium", "high", "critical"]},
        "customer_sentiment": {"enum": ["very_negative", "negative", "neutral", "positive",
                                        "very_positive"]},
        "affected_platform": {"enum": ["web_application", "mobile_application",
                                       "desktop_application", "public_api"]},
        "requested_contact_channel": {"enum": ["email", "phone_call", "live_chat",
                                               "no_contact_requested"]},
        "language": {"enum": ["english", "german", "french", "spanish"]},
    },
    "required": ["category", "priority", "customer_sentiment", "affected_platform",
                 "requested_contact_channel", "language"],
}
_PERSON = {"type": "object", "properties": {
    "full_name": {"type": "string"},
    "role": {"enum": ["product_manager", "engineer", "designer"]}},
    "required": ["full_name", "role"]}
_TASK = {"type": "object", "properties": {
    "owner": {"type": "string"}, "task_description": {"type": "string"},
    "due_date": {"type": "string", "format": "date"}},
    "required": ["owner", "task_description", "due_date"]}
_ARRAYS = {
    "type": "object",
    "properties": {
        "meeting_title": {"type": "string"},
        "attendees": {"type": "array", "minItems": 1, "maxItems": 4, "items": _PERSON},
        "action_items": {"type": "array", "minItems": 1, "maxItems": 4, "items": _TASK},
    },
    "required": ["meeting_title", "attendees", "action_items"],
}

SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "flat": (_FLAT, _prompt(
        "Extract the contact details as JSON.",
        "Hello, Daniel Kim here, data analyst at Brightwave Energy. Email "
        "daniel.kim@brightwave.example, phone +1 415 555 0134. Six years in the field, "
        "office-based in Austin.",
        {"full_name": "Daniel Kim", "job_title": "Data Analyst",
         "company_name": "Brightwave Energy", "email_address": "daniel.kim@brightwave.example",
         "phone_number": "+1 415 555 0134", "years_of_experience": 6,
         "works_remotely": False},
        "Hi, I'm Margaret Okonkwo-Hale, senior platform engineer at Northwind Logistics. "
        "Reach me at margaret.hale@northwind-logistics.example or +44 20 7946 0958. I've "
        "been doing infrastructure work for 12 years and I work fully remote.")),
    "nested": (_NESTED, _prompt(
        "Extract each order as JSON.",
        "Order for Amélie Dubois, shipping to 8 Rue des Lilas, 69003 Lyon, France. Paid "
        "89.90 EUR by PayPal; standard shipping, no gift wrap.",
        {"customer": {"first_name": "Amélie", "last_name": "Dubois"},
         "shipping_address": {"street_address": "8 Rue des Lilas", "postal_code": "69003",
                              "city": "Lyon", "country": "France"},
         "payment": {"amount": 89.9, "currency_code": "EUR", "payment_method": "paypal"},
         "delivery_options": {"express_shipping": False, "gift_wrapping": False}},
        "Order for Jonas Lindqvist, shipping to Storgatan 14, 114 55 Stockholm, Sweden. He "
        "paid 1249.50 SEK by credit card; deliver with express shipping, gift wrapped.")),
    "enums": (_ENUMS, _prompt(
        "Classify each support ticket as JSON.",
        "Subject: feature idea\nIt would be lovely to export my invoices as CSV from the "
        "website. No rush, just an idea! Feel free to email me.",
        {"category": "feature_request", "priority": "low", "customer_sentiment": "positive",
         "affected_platform": "web_application", "requested_contact_channel": "email",
         "language": "english"},
        "Subject: app keeps logging me out!!\nEvery time I switch to the billing page the "
        "mobile app logs me out and I lose my cart. This is the third time this week, I'm "
        "really frustrated. Please call me back.")),
    "arrays": (_ARRAYS, _prompt(
        "Turn meeting notes into JSON.",
        "Design sync: Ana Souza (designer) and Ben Carter (engineer) met. Ben will update "
        "the icon set by 2026-05-02.",
        {"meeting_title": "Design sync",
         "attendees": [{"full_name": "Ana Souza", "role": "designer"},
                       {"full_name": "Ben Carter", "role": "engineer"}],
         "action_items": [{"owner": "Ben Carter", "task_description": "Update the icon set",
                           "due_date": "2026-05-02"}]},
        "Quarterly roadmap review: attendees were Priya Raman (product manager), Tom "
        "Becker (engineer), Lucia Ferreira (designer) and Sam Osei (engineer). Priya will "
        "draft the Q3 roadmap by 2026-07-10; Tom will fix the login timeout by "
        "2026-07-03; Lucia will deliver the new onboarding mockups by 2026-07-08.")),
}
# Two prompts more, where the model writes the document free as well as constrained:
# **enums2**, the enums with two examples of other labels (with one, this 270M model
# copies the example's labels, free and constrained); **arrays2**, the arrays with an
# example of the answer's shape (four attendees, three action items; with two and one,
# the free text goes on listing invented attendees, a loop the n-gram drafts copy).
_TICKET = SCHEMAS["enums"][1].rsplit("Text: ", 1)[1].removesuffix("\nJSON:\n")
SCHEMAS["enums2"] = (_ENUMS, (
    "Classify each support ticket as JSON.\n\n"
    + "".join(f"Text: {text}\nJSON:\n{json.dumps(document)}\n\n" for text, document in (
        ("Subject: feature idea\nIt would be lovely to export my invoices as CSV from the "
         "website. No rush, just an idea! Feel free to email me.",
         {"category": "feature_request", "priority": "low", "customer_sentiment": "positive",
          "affected_platform": "web_application", "requested_contact_channel": "email",
          "language": "english"}),
        ("Betreff: Paket fehlt\nMeine Bestellung ist seit zwei Wochen nicht angekommen. "
         "Bitte rufen Sie mich an, das ist dringend.",
         {"category": "shipping_and_delivery", "priority": "high",
          "customer_sentiment": "negative", "affected_platform": "desktop_application",
          "requested_contact_channel": "phone_call", "language": "german"})))
    + f"Text: {_TICKET}\nJSON:\n"))
_NOTES = SCHEMAS["arrays"][1].rsplit("Text: ", 1)[1].removesuffix("\nJSON:\n")
SCHEMAS["arrays2"] = (_ARRAYS, _prompt(
    "Turn meeting notes into JSON.",
    "Design sync: Ana Souza (designer), Ben Carter (engineer), Chloe Martin (product "
    "manager) and Dev Patel (engineer) met. Ben will update the icon set by 2026-05-02; "
    "Chloe will write the release notes by 2026-05-04; Dev will review the color tokens "
    "by 2026-05-06.",
    {"meeting_title": "Design sync",
     "attendees": [{"full_name": "Ana Souza", "role": "designer"},
                   {"full_name": "Ben Carter", "role": "engineer"},
                   {"full_name": "Chloe Martin", "role": "product_manager"},
                   {"full_name": "Dev Patel", "role": "engineer"}],
     "action_items": [
         {"owner": "Ben Carter", "task_description": "Update the icon set",
          "due_date": "2026-05-02"},
         {"owner": "Chloe Martin", "task_description": "Write the release notes",
          "due_date": "2026-05-04"},
         {"owner": "Dev Patel", "task_description": "Review the color tokens",
          "due_date": "2026-05-06"}]},
    _NOTES))
# And bench.py's structured prompt (orders as JSON lines after two examples): its
# document is mostly a copy of the second example, where guesses of what follows the
# forced text pay more than in a document extracted from a text.
SCHEMAS["orders"] = (STRUCTURED_SCHEMA, STRUCTURED_PROMPT)
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
}
# Sampled, each seed is one document: its own path through the drafts (a copy of the
# example or not, a value drafted right or not), so one seed measures that document.
SEEDS: dict[str, tuple[int | None, ...]] = {"greedy": (None,), "sampled": (7, 8, 9)}
MAX_TOKENS = 400
SIDES = ("forced", "no_forced", "free", "free_plain")


def _request(name: str, sampling: str, side: str, max_tokens: int,
             seed: int | None = None) -> dict[str, Any]:
    schema, prompt = SCHEMAS[name]
    request: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                               **SAMPLINGS[sampling]}
    if seed is not None:
        request["seed"] = seed
    if not side.startswith("free"):
        request["json_schema"] = schema
    return request


def _server_request(name: str, sampling: str, seed: int | None) -> dict[str, Any]:
    """The constrained request as llama-server's /completion takes it (its own schema
    conversion; greedy as top_k 1)."""
    schema, prompt = SCHEMAS[name]
    settings = dict(SAMPLINGS[sampling])
    if settings["temperature"] == 0.0:
        settings["top_k"] = 1
    if seed is not None:
        settings["seed"] = seed
    return {"prompt": prompt, "n_predict": MAX_TOKENS, "stream": False, "json_schema": schema,
            "cache_prompt": True, **settings}


def _server_row(server: LlamaServer, name: str, sampling: str,
                seed: int | None) -> dict[str, Any]:
    status, reply = server.call("POST", "/completion", _server_request(name, sampling, seed))
    if status != 200:
        raise RuntimeError(f"llama-server answered {status}: {reply}")
    tokens = int(reply["tokens_predicted"])
    return {"schema": name, "sampling": sampling, "side": "server",
            "decode_tok_s": float(reply["timings"]["predicted_per_second"]), "tokens": tokens,
            "finish_reason": "stop" if reply.get("stop_type") == "eos" else "length",
            "usage": {}, "text": reply["content"]}


async def one_run(params: dict[str, Any], schemas: list[str],
                  llama_server: str | None = None) -> list[dict[str, Any]]:
    """Both daemons (and llama-server, given its binary) up together; every schema and
    sampling, each side first once. A row per (schema, sampling, side, request)."""
    server = (await asyncio.to_thread(LlamaServer.start, llama_server, params, 1)
              if llama_server else None)
    forced = await Daemon.start(params)
    plain = await Daemon.start(params, config="[speculative]\nforced_drafts = false\n")
    streams = {"forced": await Stream.open(forced.socket_path),
               "no_forced": await Stream.open(plain.socket_path)}
    streams["free"] = streams["forced"]
    streams["free_plain"] = streams["no_forced"]
    rows: list[dict[str, Any]] = []
    try:
        for stream in (streams["forced"], streams["no_forced"]):
            await stream.figures(_request("flat", "greedy", "forced", 8))  # warm-up
        for name in schemas:
            # Every request finds its prompt in the slot's cache: the first-token and
            # whole-request columns compare the documents, not a cold prompt on one side.
            for stream in (streams["forced"], streams["no_forced"]):
                await stream.figures(_request(name, "greedy", "free", 1))
            for sampling, seed, order in (
                    (kind, seed, order) for kind in SAMPLINGS for seed in SEEDS[kind]
                    for order in (SIDES, ("no_forced", "forced", "free_plain", "free"))):
                # The free request takes as many tokens as the document before it.
                tokens = MAX_TOKENS
                for side in order:
                    run = await streams[side].figures(_request(
                        name, sampling, side,
                        tokens if side.startswith("free") else MAX_TOKENS, seed))
                    done = run["done"]
                    if side == "forced":
                        tokens = done["usage"]["completion_tokens"]
                    rows.append({"schema": name, "sampling": sampling, "seed": seed,
                                 "side": side, "decode_tok_s": run["decode_tok_s"],
                                 "first_token_ms": run["first_token_ms"],
                                 "total_ms": run["total_ms"],
                                 "tokens": done["usage"]["completion_tokens"],
                                 "finish_reason": done["finish_reason"],
                                 "usage": done["usage"], "text": run["text"]})
                if server is not None:
                    rows.append(await asyncio.to_thread(_server_row, server, name,
                                                        sampling, seed))
    finally:
        for stream in (streams["forced"], streams["no_forced"]):
            await stream.close()
        await forced.stop()
        await plain.stop()
        if server is not None:
            server.stop()
    return rows


def summarize(rows: list[dict[str, Any]], schemas: list[str]) -> list[dict[str, Any]]:
    """A line per (schema, sampling): medians, paired ratios, validity and identity."""
    lines = []
    for name in schemas:
        schema = SCHEMAS[name][0]
        for sampling in SAMPLINGS:
            mine = [row for row in rows if row["schema"] == name and row["sampling"] == sampling]
            by_side = {side: [row for row in mine if row["side"] == side] for side in SIDES}
            # Rows come in pairs of requests per run: (forced, no_forced, free) x 2.
            forced, plain, free = by_side["forced"], by_side["no_forced"], by_side["free"]
            free_plain = by_side["free_plain"]
            server = [row for row in mine if row["side"] == "server"]

            def rate(side_rows: list[dict[str, Any]]) -> float:
                return statistics.median(row["decode_tok_s"] for row in side_rows)

            valid = sum(_valid(row, schema) for row in forced + plain)
            same = sum(a["text"] == b["text"] for a, b in zip(forced, plain, strict=True))
            lines.append({
                "schema": name, "sampling": sampling,
                "tokens": statistics.median(row["tokens"] for row in forced),
                "forced_tok_s": rate(forced), "no_forced_tok_s": rate(plain),
                "free_tok_s": rate(free),
                "forced_vs_free": paired_ratio(forced, "decode_tok_s", free,
                                                        "decode_tok_s"),
                "forced_vs_no_forced": paired_ratio(forced, "decode_tok_s", plain,
                                                             "decode_tok_s"),
                "no_forced_vs_free": paired_ratio(plain, "decode_tok_s", free,
                                                           "decode_tok_s"),
                "free_vs_free_plain": paired_ratio(free, "decode_tok_s", free_plain,
                                                            "decode_tok_s"),
                "forced_first_ms": statistics.median(row["first_token_ms"] for row in forced),
                "free_first_ms": statistics.median(row["first_token_ms"] for row in free),
                # The whole request, from sending it to its last token: the time ratio
                # (the same prompt, as many tokens a side).
                "forced_vs_free_total": paired_ratio(free, "total_ms", forced,
                                                              "total_ms"),
                "free_same": sum(a["text"] == b["text"]
                                 for a, b in zip(free, free_plain, strict=True)),
                "forced_drafted": sum(row["usage"]["forced_drafted_tokens"] for row in forced),
                "forced_accepted": sum(row["usage"]["forced_accepted_tokens"]
                                       for row in forced),
                "valid": valid, "documents": len(forced) + len(plain),
                "server_tok_s": rate(server) if server else float("nan"),
                "forced_vs_server": paired_ratio(forced, "decode_tok_s", server,
                                                          "decode_tok_s")
                if server else float("nan"),
                "server_valid": sum(_valid(row, schema) for row in server),
                "server_documents": len(server),
                "identical": same, "pairs": len(forced)})
    return lines


def _valid(row: dict[str, Any], schema: dict[str, Any]) -> bool:
    """A whole document that validates."""
    try:
        jsonschema.validate(json.loads(row["text"]), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return bool(row["finish_reason"] == "stop")


def print_table(lines: list[dict[str, Any]], header: str) -> None:
    server = any(line["server_documents"] for line in lines)
    print()
    print(f"Structured output, forced drafts (issue 38): {header}")
    print()
    print("| schema | sampling | doc tokens | forced tok/s | no-forced tok/s | free tok/s | "
          "forced/free | forced/no-forced | no-forced/free | forced accepted/drafted | "
          "valid | same bytes | free: daemons' ratio, same bytes | first token ms, forced, "
          "free | whole request, forced/free |"
          + (" llama-server tok/s | forced/llama-server | llama-server valid |" if server else ""))
    print("|---" * (15 + 3 * server) + "|")
    for line in lines:
        cells = (f"| {line['schema']} | {line['sampling']} | {line['tokens']:.0f} | "
                 f"{line['forced_tok_s']:.1f} | {line['no_forced_tok_s']:.1f} | "
                 f"{line['free_tok_s']:.1f} | {line['forced_vs_free']:.2f} | "
                 f"{line['forced_vs_no_forced']:.2f} | {line['no_forced_vs_free']:.2f} | "
                 f"{line['forced_accepted']}/{line['forced_drafted']} | "
                 f"{line['valid']}/{line['documents']} | {line['identical']}/{line['pairs']} | "
                 f"{line['free_vs_free_plain']:.2f}, {line['free_same']}/{line['pairs']} | "
                 f"{line['forced_first_ms']:.0f}, {line['free_first_ms']:.0f} | "
                 f"{line['forced_vs_free_total']:.2f} |")
        if server:
            cells += (f" {line['server_tok_s']:.1f} | {line['forced_vs_server']:.2f} | "
                      f"{line['server_valid']}/{line['server_documents']} |")
        print(cells)


def add_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--schemas", default=",".join(SCHEMAS),
                        help=f"comma-separated, of {', '.join(SCHEMAS)} (default: all)")


def check(args: argparse.Namespace) -> list[str]:
    unknown = set(args.schemas.split(",")) - set(SCHEMAS)
    return [f"--schemas: each of {', '.join(SCHEMAS)}"] if unknown else []


def run(bench: Bench) -> dict[str, Any]:
    return measure(bench.params, bench.runs, runner=bench.runner, header=bench.header,
                   schemas=bench.args.schemas.split(","), llama_server=bench.llama_server)


def measure(params: dict[str, Any], runs: int, *, runner: Runner, header: str = "",
            schemas: list[str] | None = None,
            llama_server: str | None = None) -> dict[str, Any]:
    names = schemas or list(SCHEMAS)
    rows: list[dict[str, Any]] = []
    for index in range(runs):
        log(f"[forced {index + 1}/{runs}] two daemons{' and llama-server' * bool(llama_server)}"
            f", {len(names)} schemas x (greedy + {len(SEEDS['sampled'])} seeds sampled) x 2 "
            "rounds ...")
        rows.extend(runner(one_run(params, names, llama_server)))
    lines = summarize(rows, names)
    print_table(lines, header or f"{runs} runs")
    return {"rows": rows, "lines": lines}
