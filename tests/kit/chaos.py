"""The chaos run's scenarios (issue 33), shared by scripts/chaos.py and
tests/lifecycle/test_chaos.py.

Each scenario drives the real daemon with the real default model, on a prompt store in
a temp folder, through one fault an operator or a crash can cause: `kill -9` while the
store writes a state, a small filesystem that fills up, a read-only store folder, the
folder deleted while running, damaged and hostile files in it. What every scenario
demands of the daemon:

- every request it accepted ends with `done` or an error line with a code other than
  `internal`, within REQUEST_TIMEOUT_S (a request cut by a kill -9 the scenario sent
  on purpose is counted apart, as `cut`);
- afterwards it answers `health` with "ok" and a short `generate` on a new connection;
- its log holds no traceback (a fault of the store is a warning line, not a crash path);
- after a restart every state whose file is still whole is restored from disk
  (`cache_source` "disk" in the done line), and no prompt is restored from a file that
  is not;
- the disk tier keeps writing once the fault is gone;
- damaged files: each is named in a warning, and reading them costs no allocation sized
  by an unchecked header (the daemon's peak virtual memory against a run without them).

How a fault is made depends on what the machine allows: a tmpfs or a read-only bind
mount needs root and mount rights (a container may refuse them); the fallbacks are a
file size limit (RLIMIT_FSIZE, set on the daemon's process with prlimit), an immutable
folder (chattr +i) or, without root, a folder without write permission. Each result
says which was used; SFCORE_CHAOS_NO_MOUNT=1 takes the fallbacks where mounts work too.

Events, not sleeps: the kill -9 lands on an inotify event of the store's folder (a
temporary file created or closed, a state renamed into place); the store's queued writes
are done when the daemon has stopped (it writes them out as it closes); a failed write is
seen in `stats` (the cache's error count).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from sfcore_daemon.store.promptstore import state_name
from tests.kit import Daemon, running_daemon
from tests.kit.faults import proc_status_kb

REQUEST_TIMEOUT_S = 60.0  # a request without its final line by then is a hang
SETTLE_TIMEOUT_S = 30.0  # for the store's first failed write on a full disk
MIN_TOKENS = 64
SLOTS = 2
STATE_MB = 3.0  # about what one ~150-token prompt's state takes (18.4 KB a token)

NAMES = ("Amber", "Birch", "Cobalt", "Dune", "Ember", "Fjord", "Garnet", "Heron", "Indigo",
         "Jasper", "Kestrel", "Lotus", "Maple", "Nickel", "Onyx", "Pine", "Quartz", "Raven",
         "Sable", "Topaz")

_MAGIC = b"SFCORE-KV-STATE\n"  # the state file's format (promptstore.py), for forged files


def prompt_of(name: str) -> str:
    """About 150 tokens, its own from the first word on (no two share a prefix), with line
    starts in its tail: a request keeps a state at the line start before its question (its
    end and the "Answer:" line start are too close past it to get their own)."""
    animals = ("cat", "dog", "owl", "fox")
    lines = [f"{name} log, entry {i}: the {animals[i % 4]} sleeps {i * 3 % 17} hours."
             for i in range(8)]
    return "\n".join(lines) + "\nQuestion: which animal sleeps longest?\nAnswer:"


class Prompts:
    """A scenario's supply of prompts, each new one with its own first word."""

    def __init__(self) -> None:
        self._names = iter(NAMES)

    def take(self, n: int) -> list[str]:
        return [prompt_of(next(self._names)) for _ in range(n)]


def store_config(root: Path) -> dict[str, Any]:
    # Two slots: requests run concurrently (a third waits in the queue) and their states'
    # writes queue up. A prompt read in one step beside the other (not 64 tokens a step)
    # keeps the run short on a loaded machine. Restores within a run come from RAM: the
    # disk tier is read after each restart.
    return {"server": {"slots": SLOTS, "prefill_per_step": 512},
            "cache": {"dir": str(root), "min_tokens": MIN_TOKENS, "ram_mb": 256},
            "model": {"n_ctx": 4096}}


# --- what a scenario saw -------------------------------------------------------------------


@dataclass
class Result:
    name: str
    fault: str = ""  # how the fault was made here
    sent: int = 0
    done: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    hangs: int = 0  # no final line within REQUEST_TIMEOUT_S, or the connection lost without one
    cut: int = 0  # in flight when the scenario itself sent kill -9
    restore_expected: int = 0  # prompts with a whole state file on disk at a restart
    restored: int = 0  # of those, restored from disk
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    last_log: str = field(default="", repr=False)  # the log of the last daemon

    @property
    def passed(self) -> bool:
        return not self.failures

    def fail(self, why: str) -> None:
        self.failures.append(why)

    def proved_restores(self) -> Result:
        """The scenario's end: it must have had whole states to restore, else it proved
        nothing about restarts."""
        if not self.restore_expected:
            self.fail("no whole state file to restore at any restart: nothing proved")
        return self

    def describe(self) -> str:
        lines = [f"{self.name} ({self.fault}): sent {self.sent}, done {self.done}, "
                 f"errors {dict(self.errors)}, hangs {self.hangs}, cut {self.cut}, "
                 f"restored {self.restored}/{self.restore_expected}"]
        lines += [f"  note: {note}" for note in self.notes]
        lines += [f"  FAIL: {failure}" for failure in self.failures]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "fault": self.fault, "sent": self.sent, "done": self.done,
                "errors": dict(self.errors), "hangs": self.hangs, "cut": self.cut,
                "restore_expected": self.restore_expected, "restored": self.restored,
                "seconds": round(self.seconds, 1), "passed": self.passed,
                "notes": self.notes, "failures": self.failures}

    # --- requests ---------------------------------------------------------------------------

    async def ask(self, daemon: Daemon, prompt: str, *,
                  killed: Callable[[], bool] = lambda: False) -> dict[str, Any] | None:
        """One greedy 4-token generation on its own connection: its done line, or None.
        `killed`: whether the scenario has sent kill -9 (a lost reply is then `cut`)."""
        self.sent += 1
        request = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": False,
                   "speculative": False}
        what = f"request for {prompt.split(maxsplit=1)[0]}"
        line: dict[str, Any] | None = None
        lost = ""
        try:
            client = await daemon.connect()
        except OSError as exc:
            lost = f"the daemon refused a connection ({exc!r})"
        else:
            try:
                await client.send(request)
                line = await client.recv(REQUEST_TIMEOUT_S)
            except TimeoutError:
                self.hangs += 1
                self.fail(f"{what}: no reply within {REQUEST_TIMEOUT_S:.0f} s")
                return None
            except (OSError, asyncio.IncompleteReadError, AssertionError) as exc:
                lost = f"connection lost ({exc!r})"  # AssertionError: a partial line
            finally:
                with contextlib.suppress(OSError, TimeoutError):
                    await client.close()
        if line is None:
            if killed():
                self.cut += 1
            else:
                self.hangs += 1
                self.fail(f"{what}: {lost or 'the daemon closed the connection unanswered'}")
            return None
        if line["type"] == "error":
            self.errors[line["code"]] += 1
            if line["code"] == "internal":
                self.fail(f"{what}: error internal: {line.get('message')}")
            return None
        if line["type"] != "done":
            self.fail(f"{what}: unexpected reply {line}")
            return None
        self.done += 1
        return line

    async def ask_all(self, daemon: Daemon, prompts: list[str], *,
                      killed: Callable[[], bool] = lambda: False,
                      ) -> list[dict[str, Any] | None]:
        return list(await asyncio.gather(*(self.ask(daemon, p, killed=killed)
                                           for p in prompts)))

    async def check_serves(self, daemon: Daemon, when: str, *, generate: bool = True) -> None:
        """health says ok, and a short generation is served, on new connections."""
        if daemon.process.returncode is not None:
            self.fail(f"{when}: the daemon exited ({daemon.process.returncode})")
            return
        try:
            async with daemon.client() as client:
                health = await client.final({"op": "health"}, REQUEST_TIMEOUT_S)
        except (OSError, TimeoutError, AssertionError) as exc:
            self.fail(f"{when}: no health reply ({exc!r})")
            return
        if health.get("status") != "ok":
            self.fail(f"{when}: health says {health}")
        if generate:
            await self.ask(daemon, "Hello")

    async def check_restores(self, daemon: Daemon, expected: dict[str, bool],
                             when: str) -> None:
        """Send each prompt again, SLOTS at a time: those expected (a whole state file of
        a prefix of theirs is on disk) must come from disk; the others (at most two, each
        evaluated: the run's time) must not."""
        prompts = [p for p in expected if expected[p]]
        prompts += [p for p in expected if not expected[p]][:2]
        for start in range(0, len(prompts), SLOTS):
            group = prompts[start:start + SLOTS]
            for prompt, done in zip(group, await self.ask_all(daemon, group), strict=True):
                source = done["timings"]["cache_source"] if done is not None else "no reply"
                name = prompt.split(maxsplit=1)[0]
                if expected[prompt]:
                    self.restore_expected += 1
                    if source == "disk":
                        self.restored += 1
                    else:
                        self.fail(f"{when}: {name}'s state file is whole, but the request "
                                  f"was served with cache_source {source!r}")
                elif source == "disk":
                    self.fail(f"{when}: {name} restored from disk without a good file")

    async def check_index_and_restores(self, daemon: Daemon, prompts: list[str],
                                       files: set[str], when: str) -> None:
        """The restarted store indexed every whole file, and serves `prompts` from them."""
        cache = await cache_stats(daemon)
        if cache["disk_files"] != len(files):
            self.fail(f"{when}: {len(files)} whole files, the store indexed "
                      f"{cache['disk_files']}")
        await self.check_restores(daemon, await expected_restores(daemon, prompts, files), when)

    def check_log(self, daemon: Daemon, when: str) -> str:
        log = daemon.log
        lines = log.splitlines()
        for index, line in enumerate(lines):
            if line.startswith("Traceback"):
                # The record that logged it, the daemon's innermost frame, the exception.
                end = next((i for i in range(index + 1, len(lines))
                            if not lines[i].startswith((" ", "\t"))), len(lines) - 1)
                frames = [i for i in range(index, end) if lines[i].startswith("  File")]
                ours = [i for i in frames if "sfcore_daemon" in lines[i]]
                frame = (ours or frames or [index])[-1]
                shown = [lines[index - 1] if index else "", *lines[frame:frame + 2], lines[end]]
                count = sum(1 for line in lines if line.startswith("Traceback"))
                self.fail(f"{when}: {count} traceback(s) in the log, the first:\n    "
                          + "\n    ".join(part.strip() for part in shown))
                break
        return log


async def cache_stats(daemon: Daemon) -> dict[str, Any]:
    async with daemon.client() as client:
        stats = await client.final({"op": "stats"}, REQUEST_TIMEOUT_S)
    assert stats["type"] == "stats", stats
    cache: dict[str, Any] = stats["cache"]
    return cache


async def wait_for_failed_write(daemon: Daemon, result: Result, when: str) -> int:
    """Wait until the store counts a failed write (`stats`: cache errors); the count."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        cache = await cache_stats(daemon)
        if cache["errors"]:
            return int(cache["errors"])
        if time.monotonic() > deadline:
            result.fail(f"{when}: no write failed within {SETTLE_TIMEOUT_S:.0f} s: {cache}")
            return 0
        await asyncio.sleep(0.05)  # no event tells when the store's thread fails a write


async def state_names(daemon: Daemon, prompts: list[str]) -> dict[str, set[str]]:
    """For each prompt, the file names its states may have: one a prefix of its tokens."""
    names = {}
    async with daemon.client() as client:
        for prompt in prompts:
            reply = await client.final({"op": "tokenize", "text": prompt}, REQUEST_TIMEOUT_S)
            tokens = reply["tokens"]
            names[prompt] = {state_name(tokens[:n]) for n in range(MIN_TOKENS, len(tokens) + 1)}
    return names


async def expected_restores(daemon: Daemon, prompts: list[str],
                            files: set[str]) -> dict[str, bool]:
    """For each prompt: whether one of `files` holds the state of a prefix of its tokens."""
    return {prompt: bool(names & files)
            for prompt, names in (await state_names(daemon, prompts)).items()}


def store_folder(root: Path) -> Path:
    """The fingerprint folder the daemon made under `root` (it exists at READY=1)."""
    folders = [path for path in root.iterdir() if path.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


def kv_files(folder: Path) -> set[str]:
    return {path.name for path in folder.glob("*.kv") if path.is_file()}


def partial_files(folder: Path) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return sorted(path.name for path in folder.iterdir() if path.name.endswith(".partial"))
    return []


@contextlib.asynccontextmanager
async def daemon_run(result: Result, root: Path, when: str, *,
                     killed: bool = False) -> AsyncIterator[Daemon | None]:
    """A daemon on the store `root`; None (and a failure) if it does not get ready.
    On leaving: SIGTERM and exit 0 (unless `killed` on purpose), and no traceback in its
    log (kept in `result.last_log`: the harness removes the file)."""
    async with contextlib.AsyncExitStack() as stack:
        daemon: Daemon | None = None
        try:
            daemon = await stack.enter_async_context(
                running_daemon(store_config(root), expect_clean_exit=False))
        except AssertionError as exc:
            result.fail(f"{when}: the daemon did not start: {str(exc)[-1500:]}")
        if daemon is None:
            yield None
            return
        yield daemon
        if daemon.process.returncode is None:
            daemon.signal(signal.SIGTERM)
        code = await daemon.wait_exit()
        if not killed and code != 0:
            result.fail(f"{when}: the daemon exited {code} on SIGTERM")
        result.last_log = result.check_log(daemon, when)


# --- faults: a small filesystem, a read-only folder, kills on writer events ---------------


def _run(*command: str) -> bool:
    if command[0] == "mount" and os.environ.get("SFCORE_CHAOS_NO_MOUNT") == "1":
        return False
    if shutil.which(command[0]) is None:
        return False
    done = subprocess.run(command, capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def _writable(folder: Path) -> bool:
    probe = folder / ".chaos-probe"
    try:
        probe.write_bytes(b"x")
    except OSError:
        return False
    probe.unlink()
    return True


class SmallDisk:
    """The store's root on a filesystem that can be filled up: a tmpfs of `size_mb` where
    root may mount one (filled with a filler file but for `free_mb`), else a file size
    limit on the daemon (RLIMIT_FSIZE below one state: every state write fails)."""

    def __init__(self, root: Path, size_mb: int) -> None:
        self.root = root
        self.tmpfs = os.geteuid() == 0 and _run(
            "mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "chaos", str(root))
        self.how = (f"tmpfs of {size_mb} MB filled to the brim" if self.tmpfs
                    else "RLIMIT_FSIZE of 1 MB on the daemon (no tmpfs mount here)")
        self._limited: tuple[int, tuple[int, int]] | None = None

    def fill(self, daemon: Daemon, free_mb: float) -> None:
        if self.tmpfs:
            stat = os.statvfs(self.root)
            fill = stat.f_bavail * stat.f_frsize - int(free_mb * (1 << 20))
            with (self.root / "filler").open("wb") as file:
                file.write(bytes(max(0, fill)))
        else:
            pid = daemon.process.pid
            old = resource.prlimit(pid, resource.RLIMIT_FSIZE)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (1 << 20, old[1]))
            self._limited = (pid, old)

    def free(self) -> None:
        if self.tmpfs:
            (self.root / "filler").unlink()
        elif self._limited is not None:
            pid, old = self._limited
            resource.prlimit(pid, resource.RLIMIT_FSIZE, old)
            self._limited = None

    def close(self) -> None:
        if self.tmpfs:
            _run("umount", "-l", str(self.root))


@contextlib.contextmanager
def read_only(root: Path, folder: Path) -> Iterator[str | None]:
    """Make the store's folder read-only for the daemon; yields how (None: no way here)."""
    undo: list[tuple[str, ...]] = []
    how = None
    if os.geteuid() == 0 and _run("mount", "--bind", str(root), str(root)):
        undo.append(("umount", "-l", str(root)))
        if _run("mount", "-o", "remount,bind,ro", str(root)) and not _writable(folder):
            how = "read-only bind mount of the store's root"
    if how is None and os.geteuid() == 0 and _run("chattr", "+i", str(folder)):
        undo.insert(0, ("chattr", "-i", str(folder)))
        if not _writable(folder):
            how = "chattr +i on the store's folder (no mount here)"
    if how is None and os.geteuid() != 0:
        folder.chmod(0o555)
        if not _writable(folder):
            how = "chmod 0555 on the store's folder (not root)"
    try:
        yield how
    finally:
        for command in undo:
            _run(*command)
        folder.chmod(0o755)


_IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x8, 0x80, 0x100
_EVENT = struct.Struct("iIII")


class FolderWatch:
    """inotify on one folder: calls `act` (synchronously, in the event loop's reader
    callback, so that nothing else runs first) on the first event of `mask` whose file
    name ends with `suffix`."""

    def __init__(self, folder: Path, mask: int, suffix: str, act: Callable[[str], None]):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if self._libc.inotify_add_watch(self.fd, str(folder).encode(), mask) < 0:
            os.close(self.fd)
            raise OSError(ctypes.get_errno(), "inotify_add_watch")
        self._suffix, self._act = suffix, act
        self.fired = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(self.fd, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        offset = 0
        while offset < len(data) and not self.fired.done():
            _, _, _, length = _EVENT.unpack_from(data, offset)
            raw = data[offset + _EVENT.size:offset + _EVENT.size + length]
            offset += _EVENT.size + length
            name = raw.rstrip(b"\0").decode(errors="replace")
            if name.endswith(self._suffix):
                try:
                    self._act(name)
                except Exception as exc:
                    self.fired.set_exception(exc)
                else:
                    self.fired.set_result(name)

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.fd)
        os.close(self.fd)


# --- the scenarios -------------------------------------------------------------------------

KILL_MOMENTS: tuple[tuple[str, int, str], ...] = (
    ("a temporary state file created", _IN_CREATE, ".partial"),
    ("a temporary state file closed, all written", _IN_CLOSE_WRITE, ".partial"),
    ("a state file renamed into place", _IN_MOVED_TO, ".kv"),
    ("every done line in (writes still queued)", 0, ""),
)


class KillSwitch:
    """SIGKILL for one daemon, remembering that it was sent (its cut replies are no fault)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.sent = False

    def kill(self, _name: str = "") -> None:
        if not self.sent:
            self.sent = True
            self.daemon.process.send_signal(signal.SIGKILL)

    def killed(self) -> bool:
        return self.sent


async def kill_during_writes(root: Path) -> Result:
    """Four runs, each killed (SIGKILL) at another moment of the store's writes of the
    states two requests keep (written once the daemon is idle after them); each restart
    must serve and restore every whole file."""
    result = Result("kill -9 during state writes",
                    fault="SIGKILL on inotify events of the store's folder")
    prompts = Prompts()
    asked: list[str] = []
    left: set[str] = set()
    for run, (moment, mask, suffix) in enumerate(KILL_MOMENTS):
        when = f"run {run + 1} (kill on {moment})"
        async with daemon_run(result, root, when, killed=True) as daemon:
            if daemon is None:
                return result
            folder = store_folder(root)
            if run:
                await result.check_serves(daemon, f"{when}, after the restart", generate=False)
            batch = prompts.take(SLOTS)
            switch = KillSwitch(daemon)
            watch = None
            if mask:
                try:
                    watch = FolderWatch(folder, mask, suffix, switch.kill)
                except OSError as exc:
                    result.notes.append(f"{when}: no inotify ({exc}); killed after the replies")
            requests = asyncio.ensure_future(result.ask_all(daemon, batch,
                                                            killed=switch.killed))
            try:
                if watch is not None:
                    await asyncio.wait({watch.fired, requests}, timeout=REQUEST_TIMEOUT_S,
                                       return_when=asyncio.FIRST_COMPLETED)
                    if requests.done() and not watch.fired.done():
                        # The store writes once the step loop waits for work: after these.
                        await asyncio.wait({watch.fired}, timeout=REQUEST_TIMEOUT_S)
                    if not watch.fired.done():
                        result.notes.append(f"{when}: the event never came; killed after")
                await requests
                switch.kill()
            finally:
                if watch is not None:
                    watch.close()
            await daemon.wait_exit()
            left |= set(partial_files(folder))
        asked += batch
    result.notes.append(f"{len(left)} temporary files left by the kills (each a kill "
                        "that landed mid-write)")
    when = "the restart after the last kill"
    async with daemon_run(result, root, when) as daemon:
        if daemon is None:
            return result
        folder = store_folder(root)
        files = kv_files(folder)
        result.notes.append(f"{len(files)} whole state files after {len(KILL_MOMENTS)} kills")
        await result.check_index_and_restores(daemon, asked, files, when)
        await result.check_serves(daemon, when)
    return result.proved_restores()


async def full_disk(root: Path) -> Result:
    """The store fills its filesystem: writes fail, requests go on; once space is back
    the same run writes again, and a restart restores every state whose file is whole."""
    result = Result("small full filesystem")
    disk = SmallDisk(root, size_mb=64)
    result.fault = disk.how
    prompts = Prompts()
    try:
        first, second = prompts.take(SLOTS), prompts.take(SLOTS)
        when = "run 1 (the disk fills, then has room again)"
        async with daemon_run(result, root, when) as daemon:
            if daemon is None:
                return result
            folder = store_folder(root)
            # Room for about one state; the two prompts keep one or more each.
            disk.fill(daemon, free_mb=STATE_MB)
            await result.ask_all(daemon, first)
            failed = await wait_for_failed_write(daemon, result, when)
            disk.free()
            await result.ask_all(daemon, second)
            names = await state_names(daemon, second)
            await result.check_serves(daemon, when)
        files = kv_files(folder)
        result.notes.append(f"{when}: {failed}+ writes failed; {len(files)} files after it")
        if partial_files(folder):
            result.fail(f"{when}: failed writes left {partial_files(folder)}")
        if not all(names[prompt] & files for prompt in second):
            result.fail(f"{when}: the prompts sent once the disk had room again have no "
                        "state file (the store stopped writing)")
        when = "run 2 (restart)"
        async with daemon_run(result, root, when) as daemon:
            if daemon is None:
                return result
            await result.check_index_and_restores(daemon, first + second, files, when)
            await result.check_serves(daemon, when, generate=False)
    finally:
        disk.close()
    return result.proved_restores()


async def read_only_folder(root: Path) -> Result:
    """States written by one run; the next finds the folder read-only: it restores them,
    serves new prompts whose writes fail, and logs warnings, not tracebacks."""
    result = Result("read-only store folder")
    prompts = Prompts()
    first = prompts.take(SLOTS)
    async with daemon_run(result, root, "run 1 (writable)") as daemon:
        if daemon is None:
            return result
        await result.ask_all(daemon, first)
    folder = store_folder(root)
    files = kv_files(folder)
    with read_only(root, folder) as how:
        result.fault = how or "none available"
        if how is None:
            result.notes.append("no way to make a folder read-only here: not run")
            return result
        when = "run 2 (read-only)"
        async with daemon_run(result, root, when) as daemon:
            if daemon is None:
                return result
            await result.check_index_and_restores(daemon, first, files, when)
            await result.ask_all(daemon, prompts.take(SLOTS))  # their states are not written
            await result.check_serves(daemon, when)
            result.notes.append(f"{when}: {(await cache_stats(daemon))['errors']} writes "
                                "refused before the stop")
        if kv_files(folder) != files:
            result.fail("the read-only folder's files changed")
    return result.proved_restores()


async def folder_deleted(root: Path) -> Result:
    """The store's whole folder removed while it writes: requests go on, and a restart
    makes the folder again, writes to it, and the next restores from it."""
    result = Result("store folder deleted while running", fault="rename + rmtree of the "
                    "store's root on the first state file renamed into place")
    prompts = Prompts()
    first = prompts.take(SLOTS)
    when = "run 1 (the folder goes)"
    async with daemon_run(result, root, when) as daemon:
        if daemon is None:
            return result
        folder = store_folder(root)
        gone = root.with_name(root.name + "-gone")

        def delete(_name: str) -> None:
            root.rename(gone)  # at once, even with a write in progress
            shutil.rmtree(gone, ignore_errors=True)

        watch = FolderWatch(folder, _IN_MOVED_TO, ".kv", delete)
        try:
            await result.ask_all(daemon, first)
            await asyncio.wait_for(watch.fired, REQUEST_TIMEOUT_S)
        except TimeoutError:
            result.fail(f"{when}: no state file was written to delete the folder after")
        finally:
            watch.close()
        # New prompts (their states have no folder to go to), and the first ones again.
        await result.ask_all(daemon, prompts.take(SLOTS))
        await result.ask_all(daemon, first)
        await result.check_serves(daemon, when)
    result.notes.append(f"{when}: the folder made again while running: {root.exists()}")
    second = prompts.take(SLOTS)
    async with daemon_run(result, root, "run 2 (restart, writes)") as daemon:
        if daemon is None:
            return result
        await result.ask_all(daemon, second)
        await result.check_serves(daemon, "run 2 (restart, writes)", generate=False)
    when = "run 3 (restart, restores)"
    async with daemon_run(result, root, when) as daemon:
        if daemon is None:
            return result
        await result.check_restores(daemon, await expected_restores(
            daemon, second, kv_files(store_folder(root))), when)
        await result.check_serves(daemon, when, generate=False)
    return result.proved_restores()


def _header(fields: Any) -> bytes:
    header = msgspec.msgpack.encode(fields)
    return _MAGIC + len(header).to_bytes(4, "little") + header


def hostile_files(fingerprint: str) -> dict[str, bytes]:
    """Files a crash, a full disk, another version or a hostile local user may leave in
    the folder, each named after what is wrong with it."""
    tokens = array.array("i", [2, 100, 200, 300]).tobytes()
    rng = random.Random(33)

    def state(**fields: Any) -> dict[str, Any]:
        return {"fingerprint": fingerprint, "tokens": tokens, "payload_bytes": 0,
                "payload_crc32": 0, **fields}

    return {
        "header-length-4GiB.kv": _MAGIC + b"\xff\xff\xff\xff" + bytes(64),
        "header-longer-than-file.kv": _MAGIC + (1000).to_bytes(4, "little") + b"\x84",
        "header-wrong-types.kv": _header({"fingerprint": 7, "tokens": "abc",
                                          "payload_bytes": "many", "payload_crc32": [1]}),
        "header-not-a-map.kv": _header([1, 2, 3]),
        "tokens-not-int32.kv": _header(state(tokens=b"\x01\x02\x03\x04\x05\x06")),
        "payload-negative.kv": _header(state(payload_bytes=-5)),
        "payload-huge.kv": _header(state(payload_bytes=1 << 62)),
        "other-fingerprint.kv": _header(state(fingerprint="f" * len(fingerprint))),
        "random-bytes.kv": rng.randbytes(4096),
        "empty.kv": b"",
    }


async def damaged_files(root: Path) -> Result:
    """States of three prompts written; then the first's files truncated, the third's
    payloads bit-flipped, and hostile files added. A restart serves, restores the
    second (untouched), evaluates the others, names every bad file in a warning, and
    keeps writing."""
    result = Result("damaged and hostile files",
                    fault="truncated and bit-flipped state files, forged headers, "
                    "random bytes, an empty file, a directory, a stale temporary file")
    prompts = Prompts()
    first = prompts.take(3)
    async with daemon_run(result, root, "run 1 (writes states)") as daemon:
        if daemon is None:
            return result
        await result.ask_all(daemon, first)
        by_prompt = await state_names(daemon, first)
        peak_before = proc_status_kb(daemon.process.pid, "VmPeak")
    folder = store_folder(root)
    names = kv_files(folder)
    truncated, kept, flipped = ([folder / n for n in sorted(by_prompt[p] & names)]
                                for p in first)
    if not (truncated and kept and flipped):
        result.fail(f"run 1 left no state file of some prompt: {sorted(names)}")
        return result
    for path in truncated:
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    for path in flipped:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    with kept[0].open("rb") as file:
        head = file.read(len(_MAGIC) + 4)
        fingerprint = msgspec.msgpack.decode(file.read(int.from_bytes(head[-4:], "little")))[
            "fingerprint"]
    hostile = hostile_files(fingerprint)
    for name, content in hostile.items():
        (folder / name).write_bytes(content)
    (folder / "a-directory.kv").mkdir()
    (folder / f".{sorted(names)[0]}.1.2.partial").write_bytes(bytes(1000))
    when = "run 2 (with the damaged files)"
    async with daemon_run(result, root, when) as daemon:
        if daemon is None:
            return result
        await result.check_restores(daemon, dict(zip(first, (False, True, False),
                                                     strict=True)), when)
        result.notes.append(f"{when}: {(await cache_stats(daemon))['errors']} files rejected")
        later = prompts.take(SLOTS)
        await result.ask_all(daemon, later)
        names = await state_names(daemon, later)
        await result.check_serves(daemon, when)
        peak = proc_status_kb(daemon.process.pid, "VmPeak")
        result.notes.append(f"{when}: peak virtual memory {peak / 2**20:.2f} GiB, "
                            f"{peak_before / 2**20:.2f} GiB without the bad files")
        if peak > peak_before + (1 << 20):
            result.fail(f"{when}: the daemon's virtual memory peaked "
                        f"{(peak - peak_before) / 2**20:.1f} GiB above a run without the bad "
                        "files (an allocation sized by an unchecked header)")
    # Written by the stop at the latest (the store writes what is queued as it closes).
    if not all(names[prompt] & kv_files(folder) for prompt in later):
        result.fail(f"{when}: the disk tier wrote no state of the prompts sent after the "
                    "bad files were found")
    # Every bad file the scan reads is named; of the bit-flipped ones (their headers are
    # whole: the payload's checksum is checked when one is read), the one restored.
    for name in [*(path.name for path in truncated), *hostile]:
        if name not in result.last_log:
            result.fail(f"{when}: no warning names {name}")
    if not any(path.name in result.last_log for path in flipped):
        result.fail(f"{when}: no warning names a bit-flipped file")
    return result.proved_restores()


Scenario = Callable[[Path], Awaitable[Result]]
SCENARIOS: dict[str, Scenario] = {
    "kill9": kill_during_writes,
    "full_disk": full_disk,
    "read_only": read_only_folder,
    "deleted": folder_deleted,
    "damaged": damaged_files,
}


async def run_scenario(name: str) -> Result:
    """One scenario on a fresh store root, removed afterwards; an exception the scenario
    did not expect becomes a failure of the result."""
    root = Path(tempfile.mkdtemp(prefix="sfchaos", dir="/tmp"))
    started = time.monotonic()
    result = Result(name)
    try:
        result = await SCENARIOS[name](root)
    except Exception as exc:
        result.fail(f"the scenario raised {exc!r}")
    finally:
        result.seconds = time.monotonic() - started
        for path in (root, root.with_name(root.name + "-gone")):
            shutil.rmtree(path, ignore_errors=True)
    return result
