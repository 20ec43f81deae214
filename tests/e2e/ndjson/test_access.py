"""Who may connect: the socket file's mode, then [server] allowed_uids / allowed_gids.

Run as root, the tests connect from child processes that have dropped to another
uid, primary gid and supplementary groups (uid/gid 65534, nobody/nogroup, and
made-up group numbers, which need no /etc/group entry), and check what the daemon
reads with SO_PEERCRED and SO_PEERGROUPS.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from typing import Any

import pytest

from tests.kit import REPO, Daemon, running_daemon

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root"),
    # The venv's interpreter may live where another user cannot read it (/root).
    pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK),
                       reason="needs /usr/bin/python3 for the unprivileged client"),
]

NOBODY = 65534
NOGROUP = 65534
CLIENTS = 4242  # a group with no name: the kernel only needs the number

# The unprivileged client, standard library only: two pipelined health requests,
# then half-close, then everything up to EOF. Allowed: two `health` lines; refused:
# one `forbidden` error and nothing for the second request.
CLIENT = r"""
import json, os, socket, sys
result = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups())}
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    result["connect_error"] = exc.__class__.__name__
else:
    try:
        s.sendall(b'{"op":"health","id":"h1"}\n{"op":"health","id":"h2"}\n')
        s.shutdown(socket.SHUT_WR)
    except OSError as exc:  # a refused peer may be closed on before it has sent
        result["send_error"] = exc.__class__.__name__
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:  # closed on with our second request unread
        result["reset"] = True
    result["lines"] = [json.loads(line) for line in data.splitlines()]
print(json.dumps(result))
"""


async def connect_as(path: str, uid: int, gid: int, groups: list[int]) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        "/usr/bin/python3", "-I", "-c", CLIENT, path,
        # extra_groups always: otherwise the child keeps root's supplementary groups.
        user=uid, group=gid, extra_groups=groups,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd="/")
    try:
        out, err = await asyncio.wait_for(process.communicate(), 60.0)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out)
    # The child really is who the test means it to be.
    assert (result["uid"], result["gid"], result["groups"]) == (uid, gid, sorted(groups))
    return result


def open_directory(daemon: Daemon) -> None:
    """The harness's temp dir is 0700 (mkdtemp); others must be able to traverse it."""
    assert stat.S_IMODE(daemon.directory.stat().st_mode) == 0o700
    os.chmod(daemon.directory, 0o711)


def answered(result: dict[str, Any]) -> bool:
    lines = result["lines"]
    if [line["type"] for line in lines] == ["health", "health"]:
        assert [line["id"] for line in lines] == ["h1", "h2"]
        return True
    assert len(lines) == 1, lines  # nothing after the refusal, h2 not executed
    assert lines[0]["type"] == "error" and lines[0]["code"] == "forbidden", lines
    return False


@pytest.mark.asyncio
async def test_allowed_uids_and_gids_primary_and_supplementary() -> None:
    config = {"server": {"socket_mode": "0666", "allowed_uids": [0], "allowed_gids": [CLIENTS]},
              "log": {"level": "debug"}}
    async with running_daemon(config) as daemon:
        open_directory(daemon)
        path = daemon.socket_path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666

        async with daemon.client() as root:  # uid 0 is listed
            assert (await root.final({"op": "health"}))["status"] == "ok"

        refused = await connect_as(path, NOBODY, NOGROUP, [])
        assert not answered(refused)
        message = refused["lines"][0]["message"]
        assert "uid 65534" in message and "gid 65534" in message, message
        assert refused["lines"][0]["id"] not in ("h1", "h2")  # refused before any request

        # Any one group in allowed_gids lets the peer in: supplementary or primary.
        assert answered(await connect_as(path, NOBODY, NOGROUP, [CLIENTS]))
        assert answered(await connect_as(path, NOBODY, NOGROUP, [100, CLIENTS, 4243]))
        assert answered(await connect_as(path, NOBODY, CLIENTS, []))
        # Near misses are refused.
        assert not answered(await connect_as(path, NOBODY, NOGROUP, [CLIENTS - 1, CLIENTS + 1]))
        assert not answered(await connect_as(path, CLIENTS, NOGROUP, []))  # a uid, not a gid

        async with daemon.client() as root:
            stats = await root.final({"op": "stats"})
        assert stats["errors"]["forbidden"] == 3, stats
        assert stats["connections"]["rejected"] == 3, stats
        # The peer's pid/uid/gid is logged at debug, refused or not.
        log = await daemon.log_with(f", 65534, {CLIENTS})")
        assert "connection from pid/uid/gid (" in log
        assert ", 65534, 65534)" in log and f", 65534, {CLIENTS})" in log, log


@pytest.mark.asyncio
async def test_allowed_uids_alone_refuses_everyone_else_root_included() -> None:
    config = {"server": {"socket_mode": "0666", "allowed_uids": [NOBODY]}}
    async with running_daemon(config) as daemon:
        open_directory(daemon)
        path = daemon.socket_path
        assert answered(await connect_as(path, NOBODY, NOGROUP, []))
        assert not answered(await connect_as(path, NOBODY - 1, NOGROUP, [NOGROUP]))
        async with daemon.client() as root:  # no exemption for root
            line = await root.recv()
            assert line is not None and line["code"] == "forbidden", line
            await root.expect_eof()


@pytest.mark.asyncio
async def test_without_lists_the_socket_mode_decides() -> None:
    # Both lists empty: anyone who can open the socket file may connect. A group-only
    # mode with the file's group set (as sfcore-ai.socket's SocketGroup= does) lets
    # that group's members in and keeps everyone else out at connect().
    config = {"server": {"socket_mode": "0660"}}
    async with running_daemon(config) as daemon:
        open_directory(daemon)
        path = daemon.socket_path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        os.chown(path, 0, CLIENTS)
        assert answered(await connect_as(path, NOBODY, NOGROUP, [CLIENTS]))
        assert answered(await connect_as(path, NOBODY, CLIENTS, []))
        refused = await connect_as(path, NOBODY, NOGROUP, [])
        assert refused.get("connect_error") == "PermissionError", refused
        async with daemon.client() as root:
            stats = await root.final({"op": "stats"})
        assert stats["errors"]["forbidden"] == 0
        assert stats["connections"]["total"] == 3  # the refused one never reached it


def test_socket_directory_of_the_service_is_traversable() -> None:
    # Under systemd the socket lives in RuntimeDirectory=, which must let clients
    # of other users through (0755), or no socket mode would help them.
    unit = (REPO / "systemd" / "sfcore-ai.service").read_text()
    assert "RuntimeDirectoryMode=0755" in unit.splitlines()
