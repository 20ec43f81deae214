#!/usr/bin/env python3
"""The benches: `scripts/bench.py SECTION... [--model PATH] [--runs N] [--json FILE]`.

Every section is a module of scripts/benchkit/sections/ (`--help` lists them); with no
section named, figures, structured and concurrency run. Each prints markdown tables of
medians (min-max) and of ratios against llama.cpp measured in the same run.

    .venv/bin/python scripts/bench.py [--runs 5] [--tokens 128] [--json bench_results.json]
    .venv/bin/python scripts/bench.py concurrency cache --runs 3 [--slots 4]
    .venv/bin/python scripts/bench.py speculative --model other.gguf --llama-server PATH
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the test kit (tests/kit: the launcher, the client) and the
# daemon's package, for the sections that drive llama.cpp

from benchkit.cli import main  # noqa: E402  (the path above first)

if __name__ == "__main__":
    sys.exit(main())
