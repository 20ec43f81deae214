"""The file-descriptor budget (system/fdlimit.py): RLIMIT_NOFILE against what both
listeners' max_connections may hold, checked once at start-up.

This file holds the tests that need no daemon and no model; those of the daemon's
process (start-up, exit) in tests/lifecycle/test_fdlimit.py.
"""

from __future__ import annotations

import pytest

from sfcore_daemon.system import fdlimit
from sfcore_daemon.system.socketfile import StartupError
from tests.kit import REPO


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    limits = {"now": (100, 4096)}
    monkeypatch.setattr(fdlimit.resource, "getrlimit", lambda _which: limits["now"])
    monkeypatch.setattr(fdlimit.resource, "setrlimit",
                        lambda _which, value: limits.update(now=value))
    caplog.set_level("INFO", logger=fdlimit.__name__)
    fdlimit.ensure_descriptors(130, "two listeners")
    assert limits["now"] == (4096, 4096)
    assert "soft limit raised from 100 to 4096" in caplog.text
    fdlimit.ensure_descriptors(130, "two listeners")  # enough now: left as it is
    assert limits["now"] == (4096, 4096)
    limits["now"] = (100, 150)
    with pytest.raises(StartupError, match="hard 150"):
        fdlimit.ensure_descriptors(130, "two listeners")


def test_the_service_sets_a_descriptor_limit() -> None:
    unit = (REPO / "systemd" / "sfcore-ai.service").read_text().splitlines()
    assert any(line.startswith("LimitNOFILE=") for line in unit)
