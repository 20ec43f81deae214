"""systemd integration: the unit files, scripts/install-service.sh, socket activation.

- `systemd-analyze verify` must have nothing to say about either unit, and
  `systemd-analyze security` must rate the service's exposure low.
- The install script runs in a temp root with stub systemctl/getent/useradd (this
  machine runs no systemd, and the test must not add users to it).
- Socket activation uses the real `systemd-socket-activate`, which listens on the
  socket, waits for the first connection and then execs the daemon with
  LISTEN_FDS=1, as systemd does for sfcore-ai.socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomli_w

from sfcore_daemon.system import openmp
from tests.kit import (
    BASE_CONFIG,
    READY_TIMEOUT_S,
    REPLY_TIMEOUT_S,
    REPO,
    STOP_TIMEOUT_S,
    Client,
    done_of,
    merge,
    tokens_text,
)

UNITS = REPO / "systemd"
INSTALL = REPO / "scripts" / "install-service.sh"
INSTALLED_EXEC = "/opt/sfcore-ai/.venv/bin/sfcore-daemon"
REPO_EXEC = REPO / ".venv" / "bin" / "sfcore-daemon"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
SOCKET_ACTIVATE = shutil.which("systemd-socket-activate")

needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="needs systemd-analyze")


# --- the unit files ----------------------------------------------------------------------


def unit_copies(directory: Path, exec_path: Path = REPO_EXEC) -> list[Path]:
    """Copies of both units whose ExecStart runs `exec_path`: verify checks that the
    binary exists, and the installed one (/opt/sfcore-ai) does not exist here."""
    assert exec_path.exists(), f"{exec_path}: run scripts/bootstrap.sh first"
    service = (UNITS / "sfcore-ai.service").read_text()
    exec_lines = [line for line in service.splitlines() if line.startswith("ExecStart=")]
    assert exec_lines == [f"ExecStart={INSTALLED_EXEC} --config /etc/sfcore-ai/server_config.toml"]
    (directory / "sfcore-ai.service").write_text(service.replace(INSTALLED_EXEC, str(exec_path)))
    shutil.copy(UNITS / "sfcore-ai.socket", directory / "sfcore-ai.socket")
    return [directory / "sfcore-ai.service", directory / "sfcore-ai.socket"]


def verify(units: list[Path]) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", *(f"./{unit.name}" for unit in units)],
        cwd=units[0].parent, capture_output=True, text=True, timeout=60, check=False)


@needs_analyze
def test_systemd_analyze_verify_has_nothing_to_say(tmp_path: Path) -> None:
    result = verify(unit_copies(tmp_path))
    # verify exits 0 even for unknown keys and unparsable values; any output fails.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@needs_analyze
def test_verify_would_notice_a_bad_unit(tmp_path: Path) -> None:
    # The check above can fail: a typo and a bad value are reported.
    units = unit_copies(tmp_path)
    text = units[0].read_text().replace("NotifyAccess=main", "NotifyAcces=main\nRestartSec=soon")
    units[0].write_text(text)
    result = verify(units)
    assert "Unknown key 'NotifyAcces'" in result.stderr, result
    assert "Failed to parse sec value" in result.stderr, result
    missing = unit_copies(tmp_path, exec_path=REPO_EXEC)
    missing[0].write_text(missing[0].read_text().replace(str(REPO_EXEC), "/nonexistent/daemon"))
    result = verify(missing)
    assert result.returncode != 0 and "is not executable" in result.stderr, result


@needs_analyze
def test_the_service_is_hardened(tmp_path: Path) -> None:
    assert SYSTEMD_ANALYZE is not None
    service = unit_copies(tmp_path)[0]
    # Exposure 0.0 (locked down) .. 10.0 (unprotected); --threshold is in tenths.
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager", "--threshold=20",
         f"./{service.name}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"Overall exposure level for sfcore-ai.service: [01]\.\d", result.stdout)


def unit_settings(name: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_settings_the_daemon_relies_on() -> None:
    service = unit_settings("sfcore-ai.service")
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]  # WATCHDOG=1 and READY=1 from the main pid
    assert service["WatchdogSec"] == ["30s"]
    assert service["Restart"] == ["on-failure"]  # a watchdog kill is a failure
    assert service["RuntimeDirectory"] == ["sfcore-ai"]
    assert service["RuntimeDirectoryPreserve"] == ["yes"]  # the activated socket lives there
    assert service["User"] == service["Group"] == ["sfcore-ai"]
    # TimeoutStopSec must leave room for the default drain_timeout_s (30 s).
    assert int(service["TimeoutStopSec"][0]) >= 40
    # Sharing the machine: a weight, never a quota; libgomp's spin window as the
    # daemon's own default (system/openmp.py).
    assert service["CPUWeight"] == ["200"]
    assert "CPUQuota" not in service and "Nice" not in service
    assert f"GOMP_SPINCOUNT={openmp.SPIN_DEFAULT}" in service["Environment"]
    assert f"export GOMP_SPINCOUNT={openmp.SPIN_DEFAULT}\n" in (
        REPO / "scripts" / "run.sh").read_text()
    socket_unit = unit_settings("sfcore-ai.socket")
    assert socket_unit["ListenStream"] == ["%t/sfcore-ai/sfcore-ai.sock"]
    assert socket_unit["Accept"] == ["no"]  # one daemon takes every connection
    assert socket_unit["SocketUser"] == ["sfcore-ai"]


# --- scripts/install-service.sh --------------------------------------------------------

STUB_SYSTEMCTL = """\
#!/bin/sh
# systemctl stand-in: records calls, keeps enabled/active units in files.
state="$(dirname "$0")/../state"
echo "systemctl $*" >> "$state/calls"
cmd="$1"; shift
[ "$1" = --quiet ] && shift
case "$cmd" in
    is-enabled) grep -qx "$1" "$state/enabled" 2>/dev/null ;;
    is-active) grep -qx "$1" "$state/active" 2>/dev/null ;;
    enable) echo "$1" >> "$state/enabled" ;;
    start) echo "$1" >> "$state/active" ;;
    daemon-reload|try-restart) ;;
    *) echo "stub systemctl: unexpected $cmd" >&2; exit 9 ;;
esac
"""

STUB_GETENT = """\
#!/bin/sh
state="$(dirname "$0")/../state"
grep "^$2:" "$state/$1" 2>/dev/null
"""

STUB_USERADD = """\
#!/bin/sh
state="$(dirname "$0")/../state"
echo "useradd $*" >> "$state/calls"
for name; do :; done
echo "$name:x:999:999::/nonexistent:/usr/sbin/nologin" >> "$state/passwd"
echo "$name:x:999:" >> "$state/group"
"""


@dataclass
class Install:
    root: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def prefix(self) -> Path:
        return self.root / "opt" / "sfcore-ai"

    @property
    def etc(self) -> Path:
        return self.root / "etc" / "sfcore-ai"

    @property
    def unit_dir(self) -> Path:
        return self.root / "etc" / "systemd" / "system"

    @property
    def calls(self) -> list[str]:
        path = self.root / "state" / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def changes(self) -> list[str]:
        """The calls that change something (not the is-enabled/is-active queries)."""
        return [call for call in self.calls if " is-" not in call]

    def run(self, *args: str, check: bool = True) -> str:
        result = subprocess.run(["bash", str(INSTALL), *args], env=self.env, capture_output=True,
                                text=True, timeout=120, check=False)
        output = result.stdout + result.stderr
        if check:
            assert result.returncode == 0, output
        return output

    def files(self) -> dict[str, tuple[int, int]]:
        """Every file under the install roots, with its size and mtime."""
        found = {}
        for top in (self.prefix, self.etc, self.unit_dir):
            for path in top.rglob("*") if top.exists() else ():
                info = path.lstat()
                found[str(path)] = (info.st_size, info.st_mtime_ns)
        return found


@pytest.fixture
def install(tmp_path: Path) -> Install:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "state").mkdir()
    for name, text in (("systemctl", STUB_SYSTEMCTL), ("getent", STUB_GETENT),
                       ("useradd", STUB_USERADD)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    setup = Install(tmp_path)
    setup.env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SFCORE_PREFIX": str(setup.prefix),
        "SFCORE_ETC": str(setup.etc),
        "SFCORE_UNIT_DIR": str(setup.unit_dir),
        "SYSTEMCTL": str(bin_dir / "systemctl"),
        "GETENT": str(bin_dir / "getent"),
        "USERADD": str(bin_dir / "useradd"),
        "PYTHON": "/usr/bin/python3",
    }
    return setup


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the install script runs as root")


@needs_root
def test_install_then_nothing_to_do_and_a_user_config_is_kept(install: Install) -> None:
    first = install.run("--no-venv", "--now")
    config = install.etc / "server_config.toml"
    service = install.unit_dir / "sfcore-ai.service"
    for expected in ("created system user sfcore-ai", f"installed {config}",
                     f"installed {service}", f"installed {install.unit_dir}/sfcore-ai.socket",
                     "ran systemctl daemon-reload", "enabled sfcore-ai.service",
                     "started sfcore-ai.service", "left alone (--no-venv)"):
        assert expected in first, first
    assert "nothing to do" not in first
    assert config.read_bytes() == (REPO / "server_config.toml").read_bytes()
    assert stat.S_IMODE(config.stat().st_mode) == 0o644
    assert (service.read_text()
            == (UNITS / "sfcore-ai.service").read_text()
            .replace("/opt/sfcore-ai", str(install.prefix))
            .replace("/etc/sfcore-ai", str(install.etc)))
    exec_start = f"ExecStart={install.prefix}/.venv/bin/sfcore-daemon --config {config}"
    assert exec_start in service.read_text().splitlines()
    useradd = [call for call in install.calls if call.startswith("useradd")]
    assert len(useradd) == 1 and "--system" in useradd[0] and useradd[0].endswith(" sfcore-ai")
    assert install.changes() == [
        useradd[0], "systemctl daemon-reload", "systemctl enable --quiet sfcore-ai.service",
        "systemctl start sfcore-ai.service"]
    # Every output line is one step: a tag, then what happened.
    assert all(re.match(r"^[a-z-]+ +\S", line) for line in first.splitlines()), first

    files = install.files()
    calls = len(install.changes())
    second = install.run("--no-venv", "--now")
    assert "nothing to do: sfcore-ai is installed and up to date" in second, second
    assert "sfcore-ai exists" in second and "is up to date" in second
    assert "sfcore-ai.service is active" in second
    assert len(install.changes()) == calls  # no useradd, reload, enable or start
    assert install.files() == files  # not even rewritten with the same bytes

    # A config the user has edited is never overwritten, and is no reason to act.
    config.write_text(config.read_text().replace("max_queue = 64", "max_queue = 8"))
    third = install.run("--no-venv")
    assert "max_queue = 8" in config.read_text()
    assert f"{config} kept: yours, never overwritten" in third, third
    assert "nothing to do" in third
    assert len(install.changes()) == calls


@needs_root
def test_a_changed_unit_is_updated_reloaded_and_the_service_restarted(install: Install) -> None:
    install.run("--no-venv", "--now")
    service = install.unit_dir / "sfcore-ai.service"
    service.write_text(service.read_text() + "\n# a local edit\n")
    before = len(install.changes())
    output = install.run("--no-venv", "--now")
    assert f"updated {service}" in output and "systemctl edit" in output, output
    assert "a local edit" not in service.read_text()
    assert install.changes()[before:] == [
        "systemctl daemon-reload", "systemctl try-restart sfcore-ai.service"]
    assert "nothing to do" not in output
    # Without --now a running service is only reported as out of date.
    service.write_text(service.read_text() + "\n# again\n")
    output = install.run("--no-venv")
    assert "running the previous version" in output, output
    assert install.changes()[-1] == "systemctl daemon-reload"


@needs_root
def test_socket_activation_enables_the_socket_unit(install: Install) -> None:
    output = install.run("--no-venv", "--socket", "--now")
    assert "enabled sfcore-ai.socket" in output and "started sfcore-ai.socket" in output, output
    assert "systemctl enable --quiet sfcore-ai.service" not in install.calls
    assert "systemctl start sfcore-ai.service" not in install.calls
    again = install.run("--no-venv", "--socket", "--now")
    assert "sfcore-ai.socket is enabled" in again and "sfcore-ai.socket is active" in again
    assert "nothing to do" in again, again


def test_dry_run_changes_nothing_and_includes_the_venv(install: Install) -> None:
    output = install.run("--dry-run", "--now")
    for expected in ("would create system user sfcore-ai",
                     f"would install {install.etc}/server_config.toml",
                     f"would create {install.prefix}/.venv (Python 3.",
                     "would install sfcore-ai 0.1.0 and sfcore-client from",
                     "llama-cpp-python from this machine's wheel",
                     f"would install {install.unit_dir}/sfcore-ai.service",
                     "would run systemctl daemon-reload", "would enable sfcore-ai.service",
                     "would start sfcore-ai.service", "dry run: nothing was changed"):
        assert expected in output, output
    assert install.files() == {}
    assert not install.root.joinpath("opt").exists()
    assert install.changes() == []  # only is-enabled / is-active queries


def test_dry_run_refuses_a_python_the_service_cannot_reach(install: Install) -> None:
    install.env["PYTHON"] = sys.executable  # under /root here (pyenv): hidden by ProtectHome
    base = sys.base_prefix
    if not base.startswith(("/root/", "/home/")):
        pytest.skip(f"this interpreter lives in {base}")
    result = subprocess.run(["bash", str(INSTALL), "--dry-run"], env=install.env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "ProtectHome" in result.stderr and "PYTHON=/usr/bin/python3" in result.stderr
    assert install.calls == []  # refused before any step


@needs_root
@pytest.mark.skipif(os.path.isdir("/run/systemd/system"), reason="systemd runs here")
def test_a_real_run_without_systemd_stops_before_changing_anything(install: Install) -> None:
    del install.env["SYSTEMCTL"]
    result = subprocess.run(["bash", str(INSTALL), "--no-venv"], env=install.env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "systemd is not running" in result.stderr, result.stderr
    assert install.files() == {} and install.calls == []


def test_help_and_bad_arguments(install: Install) -> None:
    help_text = install.run("--help")
    for option in ("--socket", "--now", "--dry-run", "--no-venv", "SFCORE_PREFIX",
                   "SFCORE_ETC", "SFCORE_UNIT_DIR", "SYSTEMCTL", "journalctl -u sfcore-ai"):
        assert option in help_text
    result = subprocess.run(["bash", str(INSTALL), "--frobnicate"], env=install.env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "--frobnicate" in result.stderr
    assert install.calls == []


@needs_analyze
@needs_root
def test_installed_units_still_verify(install: Install) -> None:
    install.run("--no-venv")
    # The venv step is skipped here: put the checkout's daemon where the unit expects it.
    bin_dir = install.prefix / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "sfcore-daemon").symlink_to(REPO_EXEC)
    units = [install.unit_dir / "sfcore-ai.service", install.unit_dir / "sfcore-ai.socket"]
    result = verify(units)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_script_passes_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run([shellcheck, str(INSTALL)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout


# --- socket activation with systemd-socket-activate ------------------------------------


@dataclass
class Activated:
    process: asyncio.subprocess.Process
    socket_path: str
    directory: Path
    notify_sock: socket.socket
    output: list[str]

    @property
    def log(self) -> str:
        return "".join(self.output)

    async def connect(self) -> Client:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(self.socket_path), REPLY_TIMEOUT_S)
        return Client(reader, writer)

    async def notification(self, prefix: str, timeout: float) -> str:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while True:
                message = (await loop.sock_recv(self.notify_sock, 4096)).decode()
                if message.startswith(prefix):
                    return message


@contextlib.asynccontextmanager
async def socket_activated(config: dict[str, object]) -> AsyncIterator[Activated]:
    assert SOCKET_ACTIVATE is not None
    directory = Path(tempfile.mkdtemp(prefix="sfa", dir="/tmp"))
    notify_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_sock.bind(str(directory / "n"))
    notify_sock.setblocking(False)
    config_path = directory / "c.toml"
    config_path.write_text(tomli_w.dumps(merge(BASE_CONFIG, config)))
    env = dict(os.environ, NOTIFY_SOCKET=str(directory / "n"), PYTHONUNBUFFERED="1")
    passed = ["NOTIFY_SOCKET", "PYTHONUNBUFFERED", "PATH", "HOME", "XDG_CACHE_HOME", "LANG"]
    process = await asyncio.create_subprocess_exec(
        SOCKET_ACTIVATE, "-l", str(directory / "a.sock"),
        # systemd-socket-activate passes the child only what -E names.
        *(arg for name in passed if name in env for arg in ("-E", name)),
        sys.executable, "-m", "sfcore_daemon", "--config", str(config_path),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env=env, cwd=str(REPO))
    assert process.stdout is not None
    output: list[str] = []
    activated = Activated(process, str(directory / "a.sock"), directory, notify_sock, output)
    stderr = process.stdout  # both streams: the activator's, then the daemon's

    async def pump() -> None:  # keep the daemon's stderr flowing, and keep it
        while line := await stderr.readline():
            output.append(line.decode(errors="replace"))

    try:
        first = await asyncio.wait_for(stderr.readline(), 30.0)
        output.append(first.decode())
        assert first.decode().startswith(f"Listening on {activated.socket_path}"), first
        pumping = asyncio.ensure_future(pump())
        try:
            yield activated
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await asyncio.wait_for(pumping, 30.0)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        notify_sock.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.asyncio
@pytest.mark.skipif(SOCKET_ACTIVATE is None, reason="needs systemd-socket-activate")
async def test_socket_activation_starts_on_the_first_connection() -> None:
    async with socket_activated({"server": {"socket_path": "/nonexistent/unused.sock"}}) as run:
        socket_file = os.lstat(run.socket_path)
        assert stat.S_ISSOCK(socket_file.st_mode)
        # Nothing started yet: only the activator listens.
        with pytest.raises(BlockingIOError):
            run.notify_sock.recv(4096)
        assert "Execing" not in run.log

        first = await run.connect()
        try:
            # The connection that starts the daemon is served by it.
            health = await first.final({"op": "health", "id": "h"}, timeout=READY_TIMEOUT_S)
            assert health["type"] == "health" and health["id"] == "h"
            assert health["status"] in ("loading", "ok")
            lines = await first.request(
                {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "id": "g"},
                timeout=READY_TIMEOUT_S)
            done = done_of(lines)
            assert done["usage"]["completion_tokens"] >= 1
            assert tokens_text(lines) or done["finish_reason"] == "stop"
            ready = await run.notification("READY=1", timeout=READY_TIMEOUT_S)
            assert f"on {run.socket_path}" in ready, ready
            second = await run.connect()
            try:
                assert (await second.final({"op": "health"}))["status"] == "ok"
            finally:
                await second.close()
        finally:
            await first.close()
        assert f"using the socket passed by systemd: {run.socket_path}" in run.log, run.log
        assert "/nonexistent/unused.sock" not in run.log

        run.process.send_signal(signal.SIGTERM)
        await run.notification("STOPPING=1", timeout=STOP_TIMEOUT_S)
        assert await asyncio.wait_for(run.process.wait(), STOP_TIMEOUT_S) == 0, run.log
        # The socket belongs to whoever created it (systemd): still there, same file.
        after = os.lstat(run.socket_path)
        assert stat.S_ISSOCK(after.st_mode)
        assert (after.st_dev, after.st_ino) == (socket_file.st_dev, socket_file.st_ino)


def test_socket_unit_path_matches_the_services_runtime_directory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the daemon binds by itself under the service is where the socket unit
    # listens (%t is /run for system units): clients need not care which is enabled.
    from sfcore_daemon.config import ServerConfig

    runtime = unit_settings("sfcore-ai.service")["RuntimeDirectory"][0]
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"/run/{runtime}")
    own = ServerConfig().resolved_socket_path()
    listen = unit_settings("sfcore-ai.socket")["ListenStream"][0]
    assert listen.replace("%t", "/run") == own == "/run/sfcore-ai/sfcore-ai.sock"
