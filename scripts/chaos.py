#!/usr/bin/env python3
"""The chaos run (issue 33): the prompt store's faults, against the real daemon.

Scenarios (tests/kit/chaos.py, which tests/lifecycle/test_chaos.py runs too): kill -9 at four
moments of the store's writes; a small filesystem filled up; a read-only store folder;
the folder deleted while the store writes; damaged and hostile files in it. Each drives
the real daemon with the real default model on a prompt store in a temp folder.

Printed: one row a scenario with the requests sent, those ended by `done`, by an error
line (by code), those without a reply within the bound (hangs), those cut by a kill -9
the scenario sent, the prompts a restart restored from disk of those with a whole state
file, and whether every check held; then each scenario's notes and failures. The exit
status is 1 if any scenario failed. `--json PATH` writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| scenario | fault made by | sent | done | errors by code | no reply | cut by kill "
            "| restored after restart | s | result |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        errors = ", ".join(f"{code} {n}" for code, n in r["errors"].items()) or "-"
        rows.append(f"| {r['name']} | {r['fault']} | {r['sent']} | {r['done']} | {errors} "
                    f"| {r['hangs']} | {r['cut']} | {r['restored']}/{r['restore_expected']} "
                    f"| {r['seconds']} | {'pass' if r['passed'] else 'FAIL'} |")
    return "\n".join(rows)


def main() -> int:
    sys.path.insert(0, str(REPO))
    from tests.kit.chaos import SCENARIOS, run_scenario

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], metavar="SCENARIO",
                        help=f"run only these ({', '.join(SCENARIOS)}); default: all")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()

    async def run_all() -> list[dict[str, Any]]:
        return [(await run_scenario(name)).as_json() for name in args.scenarios or SCENARIOS]

    results = asyncio.run(run_all())
    print(table(results))
    for r in results:
        for note in r["notes"]:
            print(f"- {r['name']}: {note}")
        for failure in r["failures"]:
            print(f"- {r['name']}: FAIL: {failure}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
