"""scripts/bench.py runs end to end (one short run; its figures are not judged here), and
its sections are one package (scripts/benchkit) with a registry and no import circle."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.kit import REPO
from tests.kit.benchkit import benchkit_module

# Hang bounds, not speed limits: the run takes about a minute on an idle 2-core machine,
# and over 12 beside a process that keeps one core busy (llama.cpp's threads spin while
# they wait for each other, so losing a core slows them several times over).
BENCH_TIMEOUT_S = 2400.0
REPLY_TIMEOUT_S = 600.0


@pytest.mark.asyncio
@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
async def test_bench_prints_every_figure_and_writes_json() -> None:
    results = Path(tempfile.mkdtemp(prefix="sfbench-")) / "results.json"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "scripts/bench.py", "--runs", "1", "--tokens", "16", "--no-peer",
        "--json", str(results), cwd=REPO, start_new_session=True,
        env={**os.environ, "SFCORE_BENCH_TIMEOUT_S": str(REPLY_TIMEOUT_S)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), BENCH_TIMEOUT_S)
    finally:
        if process.returncode is None:  # timed out: leave no benchmark process running
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert process.returncode == 0, stderr.decode()[-2000:]
    table = stdout.decode()
    for label in ("decode, greedy", "decode, sampled", "prefill, 512-token prompt",
                  "first token, short cold prompt", "1000-token prefix cached",
                  "process start to ready", "4 concurrent clients", "peak RSS"):
        assert label in table, label
    assert "[run 1/1]" in stderr.decode()  # progress is shown
    everything = json.loads(results.read_text())
    assert everything["sections"] == ["figures", "structured", "concurrency"]
    data = everything["figures"]
    assert len(data["samples"]["daemon"]) == len(data["samples"]["ceiling"]) == 1
    daemon = data["samples"]["daemon"][0]
    assert daemon["decode_tokens"] > 1 and daemon["prefix_cached_tokens"] >= 900
    assert {t["target"].split(" ")[0] for t in data["targets"]} >= {
        "decode", "prefill", "sampled", "ready", "peak"}
    # The concurrency section (daemon only here: no llama-server or batched-bench path).
    for label in ("Concurrent clients", "8 clients, aggregate", "while 3 others stream",
                  "inter-token gap p99", "8 clients >= 2 x 1 client"):
        assert label in table, label
    concurrency = everything["concurrency"]
    assert len(concurrency["samples"]["daemon"]) == 1
    assert not concurrency["samples"]["llama-server"]
    assert concurrency["samples"]["daemon"][0]["clients_8_tok_s"] > 0
    assert concurrency["samples"]["daemon"][0]["gap_prefill_count"] >= 1


def test_batched_bench_output_is_parsed_in_both_formats() -> None:
    module: Any = benchkit_module("benchkit.peers")
    jsonl = "\n".join(json.dumps({"pp": 32, "tg": 128, "pl": pl, "speed_tg": speed})
                      for pl, speed in ((1, 56.1), (4, 95.25)))
    assert module.parse_batched_bench("llama_model_loader: ...\n" + jsonl) == {1: 56.1,
                                                                               4: 95.25}
    markdown = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |    128 |    8 |   1280 |    0.512 |   500.00 |    8.465 |   120.97 |    8.977 |   142.59 |
"""
    assert module.parse_batched_bench(markdown) == {8: 120.97}
    concurrency: Any = benchkit_module("benchkit.sections.concurrency")
    assert concurrency.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert concurrency.percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_every_section_is_one_registered_module_of_the_package() -> None:
    """scripts/ holds bench.py (the entry point) and no bench_*.py; every registered
    section is a module with HELP and run, and no module of the package passes 600 lines
    nor imports one that imports it back."""
    assert not list((REPO / "scripts").glob("bench_*.py"))
    assert not (REPO / "scripts" / "benchlib.py").exists()
    sections: Any = benchkit_module("benchkit.sections")
    package = REPO / "scripts" / "benchkit"
    modules = {path.stem for path in (package / "sections").glob("*.py")} - {"__init__"}
    assert {name.rsplit(".", 1)[1] for name in sections.SECTIONS.values()} == modules
    for name in sections.SECTIONS.values():
        module = benchkit_module(name)
        assert isinstance(module.HELP, str) and callable(module.run), name
    imports: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        imports[name.removesuffix(".__init__")] = {
            node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.startswith("benchkit")}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for name in imports.get(start, ()):
            if name == target or (name not in seen and reaches(name, target, seen | {name})):
                return True
        return False

    assert not [name for name in imports if reaches(name, name, {name})]


async def run_section(*args: str) -> tuple[str, dict[str, Any]]:
    """A bench script with `args` (LLAMA_SERVER unset, so the daemon only), bounded by
    REPLY_TIMEOUT_S: its table (stdout) and the JSON it wrote."""
    results = Path(tempfile.mkdtemp(prefix="sfbench-")) / "results.json"
    process = await asyncio.create_subprocess_exec(
        sys.executable, *args, "--json", str(results), cwd=REPO, start_new_session=True,
        env={**{k: v for k, v in os.environ.items() if k != "LLAMA_SERVER"},
             "SFCORE_BENCH_TIMEOUT_S": str(REPLY_TIMEOUT_S)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), REPLY_TIMEOUT_S)
    finally:
        if process.returncode is None:  # timed out: leave no benchmark process running
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert process.returncode == 0, stderr.decode()[-2000:]
    results_json: dict[str, Any] = json.loads(results.read_text())
    return stdout.decode(), results_json


@pytest.mark.asyncio
@pytest.mark.timeout(REPLY_TIMEOUT_S + 120)
async def test_openai_section_measures_both_daemon_paths() -> None:
    """`openai` without llama-server: both daemon columns filled, the two daemon
    targets judged, the same prompt length on both paths (one rendered template)."""
    table, results_json = await run_section("scripts/bench.py", "openai", "--runs", "1",
                                            "--tokens", "8")
    assert "| daemon, NDJSON chat | daemon, /v1/chat/completions |" in table, table
    assert "llama-server, /v1/chat/completions" not in table
    section = results_json["openai"]
    ndjson, http = section["samples"]["ndjson"][0], section["samples"]["http"][0]
    for run in (ndjson, http):
        assert run["tokens"] == 8 and run["first_token_ms"] > 0 and run["decode_tok_s"] > 0
        assert run["cached_tokens"] < run["prompt_tokens"] // 2  # cold prompts
    assert ndjson["prompt_tokens"] == http["prompt_tokens"]
    assert [t["target"].split(" ")[0:2] for t in section["targets"]] == [
        ["endpoint", "decode"], ["endpoint", "first"]]


@pytest.mark.asyncio
@pytest.mark.timeout(REPLY_TIMEOUT_S + 120)
async def test_tools_section_counts_every_answer_and_forced_calls_validate() -> None:
    """`tools --seeds 2` without llama-server: one table row per (tool_choice,
    temperature, max_tokens), its counts add up to its requests, and every forced call
    of the daemon validates (tight budgets and temperature 1.0 included)."""
    table, results_json = await run_section("scripts/bench.py", "tools", "--seeds", "2")
    assert table.startswith("Tool calls: ") and "\nvalid: " in table, table
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| daemon |")]
    assert "llama-server" not in table.split("\n\n", 1)[1]
    # 2 choices x 2 temperatures x 3 max_tokens; 3 prompts x 2 seeds each.
    assert {(row[1], row[2], row[3]) for row in rows} == {
        (choice, temperature, max_tokens) for choice in ("required", "function add")
        for temperature in ("0", "1") for max_tokens in ("16", "24", "128")}
    for row in rows:
        requests, valid, invalid, no_call = (int(cell) for cell in row[4:8])
        assert requests == 6 and valid + invalid + no_call == requests, row
        assert valid == requests and row[8] == "100.0", row
    section = results_json["tools"]
    assert section["seeds"] == 2 and len(section["rows"]) == len(rows)
    assert all(row["valid"] == row["requests"] == 6 and row["errors"] == 0
               for row in section["rows"])


@pytest.mark.asyncio
@pytest.mark.timeout(REPLY_TIMEOUT_S + 120)
async def test_forced_section_compares_three_sides_and_every_document_validates() -> None:
    """`forced` on one schema: a table line per sampling, every constrained document
    valid, forced tokens drafted and accepted."""
    table, results_json = await run_section("scripts/bench.py", "forced", "--runs", "1",
                                            "--schemas", "nested")
    assert "| nested | greedy |" in table and "| nested | sampled |" in table, table
    lines = results_json["forced"]["lines"]
    assert [line["sampling"] for line in lines] == ["greedy", "sampled"]
    # Forced and no forced, each daemon first once: greedy once, sampled once a seed.
    for line, seeds in zip(lines, (1, 3), strict=True):
        assert line["valid"] == line["documents"] == 4 * seeds, line
        assert 0 < line["forced_accepted"] <= line["forced_drafted"], line
        assert line["forced_tok_s"] > 0 and line["free_tok_s"] > 0, line
        assert line["forced_first_ms"] > 0 and line["forced_vs_free_total"] > 0, line
