"""The benches' daemon launcher: a daemon subprocess on a temp socket, waited for by its
READY=1 and timed to it; and their NDJSON connection, the kit's client (tests/kit/ndjson.py,
importable because scripts/bench.py puts the repository root on sys.path)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchkit import common
from benchkit.common import SAMPLED, TIMEOUT_S, filler_text, generation_figures
from tests.kit.ndjson import Client


class Stream(Client):
    """The kit's NDJSON client (tests/kit/ndjson.py), with the figures the benches print
    of one generation (from `Client.timed`: the arrival of every reply line)."""

    async def figures(self, request: dict[str, Any]) -> dict[str, Any]:
        timed = await self.timed(request, TIMEOUT_S)
        done = timed.final
        if done["type"] != "done":
            raise RuntimeError(f"daemon answered {done}")
        usage = done["usage"]
        figures = generation_figures(timed.started, timed.first, timed.last,
                                     usage["completion_tokens"],
                                     prompt_tokens=usage["prompt_tokens"],
                                     cached_tokens=usage["cached_tokens"])
        figures["done"] = done
        figures["text"] = timed.text
        return figures

    async def generate(self, text: str, tokens: int, sampled: bool = False,
                       cache: bool = True) -> dict[str, Any]:
        sampling = SAMPLED if sampled else {"temperature": 0.0}
        return await self.figures(
            {"prompt": text, "max_tokens": tokens, "cache_prompt": cache, **sampling})


class Daemon:
    """A daemon subprocess on a temp socket; `ready_ms` from spawn to READY=1."""

    def __init__(self, process: asyncio.subprocess.Process, workdir: Path,
                 ready_ms: float) -> None:
        self.process, self.workdir, self.ready_ms = process, workdir, ready_ms
        self.socket_path = str(workdir / "s")
        self.log_path: Path | None = None
        # The READY=1 notification (its STATUS= names the OpenAI endpoint's address).
        self.ready_status = ""

    @classmethod
    async def start(cls, params: dict[str, Any], log_path: Path | None = None, *,
                    config: str = "", log_level: str = "warning",
                    append: bool = False) -> Daemon:
        """Spawn the daemon and wait for READY=1; RuntimeError (with its log's tail) as
        soon as it exits instead. `config`: TOML sections of its own, `[cache]` included
        (by default a prompt store in the workdir, so that no run restores states an
        earlier run left in the user's cache), after params' daemon_config (the command
        line's --daemon-config). `append`: add to `log_path`'s lines."""
        workdir = Path(tempfile.mkdtemp(prefix="sfbench-", dir="/tmp"))
        config_path = workdir / "config.toml"
        server = f'[server]\nslots = {params["slots"]}\n' if params.get("slots") else ""
        config = (params.get("daemon_config") or "") + "\n" + config
        if "[cache]" not in config:
            config += f"[cache]\ndir = {json.dumps(str(workdir / 'prompts'))}\n"
        config_path.write_text(f'{server}[model]\npath = {json.dumps(params["model"])}\n'
                               f'n_ctx = {params["n_ctx"]}\n{config}'
                               f'[log]\nlevel = "{log_level}"\n')
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(workdir / "n"))
        notify.setblocking(False)
        loop = asyncio.get_running_loop()
        # A log file, not a pipe, when the daemon may log much before stop() reads it.
        stderr = (log_path.open("ab" if append else "wb") if log_path is not None
                  else subprocess.PIPE)
        started = time.perf_counter()
        process: asyncio.subprocess.Process | None = None
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sfcore_daemon", "--config", str(config_path),
                "--socket", str(workdir / "s"), cwd=common.REPO,
                env={**os.environ, "NOTIFY_SOCKET": str(workdir / "n")},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
            deadline = started + TIMEOUT_S
            while True:
                if process.returncode is not None or time.perf_counter() > deadline:
                    tail = log_tail(log_path) if log_path is not None else ""
                    raise RuntimeError(f"the daemon did not start (exit "
                                       f"{process.returncode}): {tail}")
                try:
                    notification = await asyncio.wait_for(loop.sock_recv(notify, 4096), 1.0)
                    if b"READY=1" in notification:
                        break
                except TimeoutError:
                    pass
        except BaseException:
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            notify.close()
            if log_path is not None:
                stderr.close()  # type: ignore[union-attr]  # the child has its own copy
        daemon = cls(process, workdir, (time.perf_counter() - started) * 1e3)
        daemon.log_path = log_path
        daemon.ready_status = notification.decode(errors="replace")
        return daemon

    async def stop(self) -> str:
        """Stop the daemon; its log."""
        self.process.terminate()
        _, piped = await asyncio.wait_for(self.process.communicate(), TIMEOUT_S)
        shutil.rmtree(self.workdir, ignore_errors=True)
        log = (self.log_path.read_bytes() if self.log_path is not None else piped).decode(
            errors="replace")
        if self.process.returncode != 0:
            raise RuntimeError(f"the daemon exited with {self.process.returncode}: {log}")
        return log


def log_tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


async def fit_prompt(path: str, target: int, seed: int) -> str:
    """The longest filler text of at most `target` tokens, by the daemon's tokenizer."""
    stream = await Stream.open(path)
    try:
        async def count(text: str) -> int:
            reply = await stream.final({"op": "tokenize", "text": text}, TIMEOUT_S)
            return len(reply["tokens"])

        low, high = 1, target
        while low < high:
            middle = (low + high + 1) // 2
            if await count(filler_text(middle, seed)) <= target:
                low = middle
            else:
                high = middle - 1
    finally:
        await stream.close()
    return filler_text(low, seed)
