"""What the ops and admission read of the running daemon, in one object.

`Server` creates one `ServerState` and fills it in as the daemon starts (the engine,
scheduler and chat template once the model is loaded) and stops (`draining`); the
ops and admission are given it, so none of them reaches into the server.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sfcore_daemon.config import Config
from sfcore_daemon.core.chat import ChatTemplate
from sfcore_daemon.core.scheduler import Scheduler
from sfcore_daemon.core.stats import Stats
from sfcore_daemon.engine.thread import Engine
from sfcore_daemon.llama.model import EngineClosed


@dataclass(eq=False)
class ServerState:
    config: Config
    cpus: list[int]
    stats: Stats = field(default_factory=Stats)
    # Set once the model is loaded and warmed up.
    engine: Engine | None = None
    scheduler: Scheduler | None = None
    chat_template: ChatTemplate | None = None
    # No new requests: the daemon is stopping, or its decode thread died.
    draining: bool = False
    # Set once the model is loaded and warmed up (`health` says "ok").
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the load has ended either way: requests waiting for the model then
    # run, or are answered `shutting_down` if the load was given up.
    load_ended: asyncio.Event = field(default_factory=asyncio.Event)

    async def loaded_engine(self) -> Engine:
        """The engine once loaded; EngineClosed if the load was given up for a stop."""
        if not self.load_ended.is_set():
            await self.load_ended.wait()
        if self.engine is None:
            raise EngineClosed("the daemon stopped before the model was loaded")
        return self.engine

    @property
    def status(self) -> str:
        """What `health` says: "loading", "ok", or "draining" (stopping, or the decode
        thread died)."""
        return "draining" if self.draining else "ok" if self.ready.is_set() else "loading"

    @property
    def speculates(self) -> bool:
        """Whether generations may draft."""
        return self.config.speculative.mode != "off"
