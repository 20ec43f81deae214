"""The benches' daemon: the kit's launcher (tests/kit/daemon.py, `start_daemon`) with the
benches' configuration, and their NDJSON connection, the kit's client (tests/kit/ndjson.py);
both importable because scripts/bench.py puts the repository root on sys.path."""

from __future__ import annotations

import asyncio
import os
import tomllib
from pathlib import Path
from typing import Any

from benchkit import common
from benchkit.common import SAMPLED, TIMEOUT_S, filler_text, generation_figures
from tests.kit import daemon as kit
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
    """A daemon of the kit's launcher (`kit`) on a temp socket; `ready_ms` from its spawn
    to READY=1. Its configuration is the daemon's defaults and the bench's parameters,
    not the tests' BASE_CONFIG."""

    def __init__(self, daemon: kit.Daemon) -> None:
        self.kit = daemon

    @property
    def socket_path(self) -> str:
        return self.kit.socket_path

    @property
    def process(self) -> asyncio.subprocess.Process:
        return self.kit.process

    @property
    def workdir(self) -> Path:
        return self.kit.directory

    @property
    def log_path(self) -> Path:
        return self.kit.log_path

    @property
    def ready_ms(self) -> float:
        return self.kit.ready_ms

    @property
    def ready_status(self) -> str:
        """The READY=1 notification (its STATUS= names the OpenAI endpoint's address)."""
        return self.kit.ready_message

    @classmethod
    async def start(cls, params: dict[str, Any], log_path: Path | None = None, *,
                    config: str = "", log_level: str = "warning", append: bool = False,
                    tree: Path | str | None = None) -> Daemon:
        """Spawn the daemon and wait for READY=1; RuntimeError (with its log's tail) as
        soon as it exits instead. `config`: TOML sections of its own, `[cache]` included
        (by default a prompt store in the workdir, so that no run restores states an
        earlier run left in the user's cache), over params' daemon_config (the command
        line's --daemon-config). Its log goes to `log_path` (`append`: after the file's
        lines), by default a file in its workdir. `tree`: the checkout whose daemon runs
        (by default this one)."""
        settings: dict[str, Any] = {"model": {"path": params["model"],
                                              "n_ctx": params["n_ctx"]}}
        if params.get("slots"):
            settings["server"] = {"slots": params["slots"]}
        for text in (params.get("daemon_config") or "", config):
            settings = kit.merge(settings, tomllib.loads(text))
        settings = kit.merge(settings, {"log": {"level": log_level}})
        try:
            daemon = await kit.start_daemon(
                settings, base=None, log_path=log_path, append_log=append,
                tree=tree or common.REPO, ready_timeout=TIMEOUT_S,
                # The daemon as a user runs it: no thread checks unless asked for.
                env={"SFCORE_CHECK_THREADS": os.environ.get("SFCORE_CHECK_THREADS", "")})
        except kit.NoNotification as error:
            raise RuntimeError(f"the daemon did not start (exit {error.code}): "
                               f"{error.log[-2000:]}") from None
        return cls(daemon)

    async def stop(self) -> str:
        """Stop the daemon (killed if that fails) and remove its workdir; its log
        (RuntimeError with it if it exits other than 0)."""
        try:
            code = await self.kit.stop(TIMEOUT_S)
            log = self.kit.log
        finally:
            await self.kit.close()
        if code != 0:
            raise RuntimeError(f"the daemon exited with {code}: {log}")
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
