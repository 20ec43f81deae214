"""Who may talk to the daemon: `[server] allowed_uids` / `allowed_gids`, one rule for
every listener (the NDJSON socket and the OpenAI one); each listener finds the peer's
uid and groups its own way and asks here."""

from __future__ import annotations

from collections.abc import Callable

from sfcore_daemon.config import ServerConfig


def restricted(config: ServerConfig) -> bool:
    return bool(config.allowed_uids or config.allowed_gids)


def refusal(config: ServerConfig, uid: int, gid: int,
            groups: Callable[[], set[int]]) -> str | None:
    """Why the peer (uid, primary gid) may not talk to the daemon, or None if it may.
    `groups` (its supplementary groups) is asked only when the uid alone does not do."""
    if not restricted(config) or uid in config.allowed_uids:
        return None
    if config.allowed_gids and ({gid} | groups()) & set(config.allowed_gids):
        return None
    return (f"uid {uid} (gid {gid}) is not in server.allowed_uids and none of its groups "
            "in server.allowed_gids")
