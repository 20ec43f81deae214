"""The registry: every section of scripts/bench.py, by name, in its module here.

A section is a module with
    HELP = "..."                  one line, shown by --help
    DEFAULTS = {...}              optional: its own defaults of the shared options
                                  (runs, tokens, n_ctx, slots) where the command line
                                  gives none
    add_arguments(parser)         optional: options of its own (names no other section uses)
    run(bench) -> dict            measures, prints its tables to stdout (progress to
                                  stderr, benchkit.common.log), returns what --json keeps
                                  under its name; bench is a benchkit.context.Bench
and one line in SECTIONS below. Adding a section: write the module, add its line.
"""

from __future__ import annotations

SECTIONS = {
    "figures": "benchkit.sections.figures",
    "structured": "benchkit.sections.structured",
    "concurrency": "benchkit.sections.concurrency",
    "speculative": "benchkit.sections.speculative",
    "cache": "benchkit.sections.cache",
    "openai": "benchkit.sections.openai",
    "tools": "benchkit.sections.tools",
    "forced": "benchkit.sections.forced",
    "structured-budget": "benchkit.sections.structured_budget",
    "grammar-gaps": "benchkit.sections.grammar_gaps",
    "logprobs": "benchkit.sections.logprobs",
    "spec-rows": "benchkit.sections.spec_rows",
    "spec-replay": "benchkit.sections.spec_replay",
    "agents": "benchkit.sections.agents",
    "contention": "benchkit.sections.contention",
    "versions": "benchkit.sections.versions",
    "longctx": "benchkit.sections.longctx",
    "beside": "benchkit.sections.beside",
    "reproducible": "benchkit.sections.reproducible",
    "zoo": "benchkit.sections.zoo",
}
# What `scripts/bench.py` runs given no section.
DEFAULT = ("figures", "structured", "concurrency")
