"""The NDJSON front end: the Unix socket, its connections, and their part of a shutdown."""

from __future__ import annotations

import asyncio
import logging

from sfcore_daemon.config import Config
from sfcore_daemon.core import access, errors
from sfcore_daemon.core.state import ServerState
from sfcore_daemon.ndjson import protocol
from sfcore_daemon.ndjson.connection import Connection
from sfcore_daemon.ndjson.ops import Ops
from sfcore_daemon.system.peers import peer_credentials, peer_groups
from sfcore_daemon.system.socketfile import ListeningSocket

log = logging.getLogger(__name__)

_CLOSE_GRACE_S = 5.0
API = "ndjson"


class NdjsonListener:
    """A `core.server.Frontend`: the socket bound before the model loads, one
    `Connection` per client, each served by the one `Ops`."""

    def __init__(self, config: Config, listening: ListeningSocket) -> None:
        self.config = config
        self._listening = listening
        self.socket_path = listening.path
        self.connections: set[Connection] = set()
        self._connection_tasks: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Future[None]] = set()
        self._listener: asyncio.AbstractServer | None = None
        self._state: ServerState | None = None
        self._ops: Ops | None = None

    def describe(self) -> str:
        return self.socket_path

    async def start(self, state: ServerState) -> None:
        self._state = state
        self._ops = Ops(state)
        state.stats.count_ops((op, API) for op in protocol.KNOWN_OPS)
        if self._listening.identity is None:
            log.info("using the socket passed by systemd: %s", self.socket_path)
        self._listener = await asyncio.start_unix_server(self._accept, sock=self._listening.sock)

    async def stop_accepting(self) -> None:
        if self._listener is not None:
            self._listener.close()
        # Connections with nothing running are answered and closed now; the others
        # close once their running request has finished.
        for connection in list(self.connections):
            if not connection.generating:
                self._closing.add(asyncio.ensure_future(connection.close_after_replies()))

    async def close(self) -> None:
        waits = [asyncio.ensure_future(c.replies_done.wait()) for c in self.connections]
        if waits:
            await asyncio.wait(waits, timeout=_CLOSE_GRACE_S)
            for waiter in waits:
                waiter.cancel()
        for connection in list(self.connections):
            connection.gone = True
            connection.may_read.set()
            connection.transport.close()
        tasks = [*self._connection_tasks, *self._closing]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_GRACE_S)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self._state is not None and self._ops is not None
        stats = self._state.stats
        self._connection_tasks.add(task)
        connection = Connection(self._ops, reader, writer)
        stats.connections_total += 1
        try:
            rejection = self._admission_error(writer)
            if rejection is not None:
                stats.connections_rejected += 1
                code, message = rejection
                connection.reply_error(None, code, message)
                await connection.close_after_replies()
                return
            self.connections.add(connection)
            stats.connections_current = len(self.connections)
            await connection.serve()
        except asyncio.CancelledError:
            connection.drop("daemon stopping")
        except Exception:
            log.exception("connection handler failed")
            connection.drop("internal error")
        finally:
            self.connections.discard(connection)
            stats.connections_current = len(self.connections)
            self._connection_tasks.discard(task)

    def _admission_error(self, writer: asyncio.StreamWriter) -> tuple[str, str] | None:
        assert self._state is not None
        server_config = self.config.server
        if self._state.draining:
            return errors.SHUTTING_DOWN, "the daemon is shutting down"
        restricted = access.restricted(server_config)
        if restricted or log.isEnabledFor(logging.DEBUG):
            sock = writer.get_extra_info("socket")
            creds = peer_credentials(sock)
            log.debug("connection from pid/uid/gid %s", creds)
            if restricted:
                if creds is None:
                    return errors.FORBIDDEN, "cannot read the peer's credentials"
                _, uid, gid = creds
                why = access.refusal(server_config, uid, gid, lambda: peer_groups(sock))
                if why is not None:
                    return errors.FORBIDDEN, why
        if len(self.connections) >= server_config.max_connections:
            return (errors.TOO_MANY_CONNECTIONS,
                    f"server.max_connections ({server_config.max_connections}) already open")
        return None
