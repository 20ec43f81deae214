"""Forced drafts (structured/forced.py) through the real daemon: the text a json_schema's
grammar forces is drafted and verified, and the model still picks every token.

- Exact: with drafts of at most 2 tokens every step's rows are computed bit for bit as
  lone rows (test_speculative.py), so a constrained request gives the same bytes with
  speculation as one token a step, greedy and sampled, while forced tokens are drafted.
- Counted: usage, stats and metrics carry the forced drafted and accepted tokens; with
  `[speculative] forced_drafts = false` there are none, and the documents still validate.
- Tight budgets: documents closed early to fit max_tokens stay valid with forced drafts.
- Tool calls with tool_choice "required" draft their call's forced text too.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.kit import Daemon, done_of, merge, running_daemon, tokens_text

pytestmark = pytest.mark.asyncio

CONTACT = {
    "type": "object",
    "properties": {
        "full_name": {"type": "string", "maxLength": 40},
        "job_title": {"type": "string", "maxLength": 40},
        "status": {"enum": ["active_customer", "former_customer", "prospect"]},
        "address": {"type": "object", "properties": {
            "city_name": {"type": "string", "maxLength": 24},
            "postal_code": {"type": "string", "maxLength": 10}},
            "required": ["city_name", "postal_code"]},
        "years_known": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["vip", "new"]}},
    },
    "required": ["full_name", "job_title", "status", "address", "years_known", "tags"],
}
# Extraction: the new document's values are in the text, so its string values are drafted
# as copies of the prompt (copying.py) besides the forced text.
PROMPT = ("Contacts as JSON.\n"
          "Text: Ada Lovelace, an analyst in London (NW1 6XE), a prospect we have known for "
          "3 years, vip.\n"
          'JSON: {"full_name": "Ada Lovelace", "job_title": "Analyst", "status": "prospect", '
          '"address": {"city_name": "London", "postal_code": "NW1 6XE"}, "years_known": 3, '
          '"tags": ["vip"]}\n'
          "Text: Grace Hopper, a rear admiral in Arlington (22201), an active customer we have "
          "known for 12 years, new.\n"
          "JSON: ")
ONE_SLOT = {"server": {"slots": 1}}
# The row-invariant kernels: each row of a step is computed as a lone row.
EXACT = merge(ONE_SLOT, {"speculative": {"draft_max": 2, "draft_start": 2},
                         "model": {"reproducible": True}})
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 11}


async def generate(daemon: Daemon, **request: Any) -> dict[str, Any]:
    async with daemon.client() as client:
        lines = await client.request({"prompt": PROMPT, "max_tokens": 120, "stream": True,
                                      "json_schema": CONTACT, **request})
    done = done_of(lines)
    assert done["type"] == "done", done
    return {**done, "text": tokens_text(lines)}


def valid(text: str) -> None:
    jsonschema.validate(json.loads(text), CONTACT)


async def test_forced_drafts_give_the_bytes_of_one_token_a_step() -> None:
    async with running_daemon(EXACT) as daemon:
        for sampling in ({"temperature": 0.0}, SAMPLED):
            plain = await generate(daemon, speculative=False, **sampling)
            fast = await generate(daemon, **sampling)
            assert fast["text"] == plain["text"]
            valid(fast["text"])
            assert fast["finish_reason"] == plain["finish_reason"] == "stop"
            usage = fast["usage"]
            assert plain["usage"]["forced_drafted_tokens"] == 0
            assert 0 < usage["forced_accepted_tokens"] <= usage["forced_drafted_tokens"]
            assert usage["forced_drafted_tokens"] <= usage["drafted_tokens"]
            assert usage["forced_accepted_tokens"] <= usage["accepted_tokens"]
        # Drafts only save steps: a failure in them is contained and logged, never silent.
        assert "the request went on without it" not in daemon.log


async def stats_and_metrics(daemon: Daemon) -> tuple[dict[str, Any], str]:
    async with daemon.client() as client:
        stats = await client.final({"op": "stats"})
        metrics = await client.final({"op": "metrics"})
    return stats["speculative"], metrics["text"]


def metric(text: str, name: str) -> int:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    raise AssertionError(f"{name} is not in the metrics")


async def test_forced_tokens_are_counted_in_usage_stats_and_metrics() -> None:
    async with running_daemon(ONE_SLOT) as daemon:
        dones = [await generate(daemon, temperature=0.0), await generate(daemon, **SAMPLED)]
        for done in dones:
            valid(done["text"])
            # Keys and punctuation come drafted, forced or copied from the example line.
            usage = done["usage"]
            assert usage["forced_accepted_tokens"] > 0, usage
            assert usage["accepted_tokens"] >= usage["completion_tokens"] // 3, usage
        counts, text = await stats_and_metrics(daemon)
        for key in ("forced_drafted", "forced_accepted"):
            total = sum(done["usage"][f"{key}_tokens"] for done in dones)
            assert counts[key] == total > 0
            assert metric(text, f"sfcore_{key}_tokens_total") == total


async def test_without_forced_drafts_nothing_is_forced_and_documents_validate() -> None:
    async with running_daemon(merge(ONE_SLOT, {"speculative": {"forced_drafts": False}})) \
            as daemon:
        done = await generate(daemon, temperature=0.0)
        valid(done["text"])
        assert done["usage"]["forced_drafted_tokens"] == 0
        counts, _ = await stats_and_metrics(daemon)
        assert counts["forced_drafted"] == counts["forced_accepted"] == 0


async def test_documents_closed_to_fit_tight_budgets_stay_valid() -> None:
    # The shortest document of CONTACT takes about 40 tokens: these budgets make the
    # closer complete it early, its planned completion drafted as forced tokens.
    async with running_daemon(ONE_SLOT) as daemon:
        forced = 0
        for max_tokens in (44, 52, 64):
            for sampling in ({"temperature": 0.0}, SAMPLED):
                done = await generate(daemon, max_tokens=max_tokens, **sampling)
                assert done["finish_reason"] == "stop", done
                assert done["usage"]["completion_tokens"] <= max_tokens
                valid(done["text"])
                forced += done["usage"]["forced_accepted_tokens"]
        assert forced > 0


WEATHER = {"type": "function", "function": {
    "name": "get_current_weather_report", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {
        "city_name": {"type": "string", "maxLength": 30},
        "temperature_unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city_name", "temperature_unit"]}}}


async def test_a_required_tool_call_drafts_its_forced_text() -> None:
    async with running_daemon(ONE_SLOT) as daemon, daemon.client() as client:
        done = await client.final({
            "op": "chat", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [WEATHER], "tool_choice": "required", "temperature": 0.0,
            "max_tokens": 96})
    assert done["finish_reason"] == "tool_calls", done
    call = done["tool_calls"][0]["function"]
    assert call["name"] == "get_current_weather_report"
    jsonschema.validate(call["arguments"], WEATHER["function"]["parameters"])
    # The function's name is a constant: the model never picks among its tokens.
    assert done["usage"]["forced_accepted_tokens"] >= 4, done["usage"]
