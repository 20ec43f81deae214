"""The suite's layout, as markers: every test is marked by the folder it lies in.

    tests/unit/<package>/   no daemon, no model: the package's logic (`-m unit`; run it
                            alone with `scripts/test.sh tests/unit`, well under a minute)
    tests/e2e/<front end>/  the real daemon and model, driven through one front end
                            (ndjson, openai, responses, anthropic, ollama, httpd: the
                            shared HTTP listener), or llama.cpp and the model in-process
                            (llama)
    tests/lifecycle/        start-up, shutdown, signals, faults, chaos, soak, stress,
                            systemd, watchdog, self-check, tune
    tests/clients/          the Go, Node, Rust and Python clients and the `sfcore` command
    tests/repo/             the repository itself: layout, lint and types, docs, the
                            llama.cpp wheel and its patches, the GPU kit, the benches

What they share (the daemon launcher, the NDJSON client, the model paths, shared data)
is the package tests/kit; the repository root is on sys.path because tests/ is a
package (pytest's rootdir insertion), so `from tests.kit import ...` works anywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
GROUPS = ("unit", "e2e", "lifecycle", "clients", "repo")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            group = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if group in GROUPS:
            item.add_marker(getattr(pytest.mark, group))
