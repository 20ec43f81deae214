"""A small client for the sfcore-ai daemon, using only the Python standard library.

    from sfcore_client import Client

    with Client() as client:                      # /tmp/sfcore-ai.sock by default
        for piece in client.generate("Jelaskan Rust dalam 1 kalimat", max_tokens=100):
            print(piece, end="", flush=True)
        print()
        print(client.last_done["usage"])           # the `done` line of the last request
        done = client.generate("Hi", stream=False, temperature=0)
        print(done["text"], done["finish_reason"])

From a shell:  python sfcore_client.py "Jelaskan Rust dalam 1 kalimat"

The wire protocol is NDJSON over a Unix socket: one JSON object per line each way.
Requests are sent one at a time on one connection; every error line becomes a
`SfcoreError(code, message)`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import sys
from collections.abc import Iterator
from types import TracebackType
from typing import Any, BinaryIO, Literal, overload

DEFAULT_SOCKET_PATH = "/tmp/sfcore-ai.sock"

# After these errors the daemon closes the connection; the next request reconnects.
_CLOSING_CODES = frozenset({"line_too_long", "too_many_connections", "forbidden", "shutting_down"})


class SfcoreError(Exception):
    """An `error` line from the daemon, e.g. code "invalid_request" or "queue_full"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Client:
    """One connection to the daemon. Not thread-safe: use one Client per thread."""

    def __init__(self, path: str = DEFAULT_SOCKET_PATH, *, timeout: float | None = None) -> None:
        self.path = path
        self.timeout = timeout
        # The `done` line of the last generate request, once it has arrived.
        self.last_done: dict[str, Any] | None = None
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._file: BinaryIO | None = None
        # True from sending a request until its last line has been read.
        self._pending = False
        self._open()

    @classmethod
    def connect(cls, path: str = DEFAULT_SOCKET_PATH, *, timeout: float | None = None) -> Client:
        return cls(path, timeout=timeout)

    # --- requests ---------------------------------------------------------------------

    @overload
    def generate(self, prompt: str, *, stream: Literal[True] = ...,
                 **options: Any) -> Iterator[str]: ...

    @overload
    def generate(self, prompt: str, *, stream: Literal[False],
                 **options: Any) -> dict[str, Any]: ...

    def generate(self, prompt: str, *, stream: bool = True,
                 **options: Any) -> Iterator[str] | dict[str, Any]:
        """Complete `prompt`. Options are the protocol's fields (max_tokens, temperature,
        top_k, top_p, min_p, repeat_penalty, seed, stop, cache_prompt); None means
        "the daemon's default".

        stream=True: an iterator of text pieces; afterwards `last_done` holds the
        `done` line. Leaving the loop early closes the connection, which makes the
        daemon stop generating; the next request reconnects.
        stream=False: the `done` line, whose "text" is the whole completion.
        """
        request = {"prompt": prompt, "stream": stream, **options}
        request_id = self._send({k: v for k, v in request.items() if v is not None})
        self.last_done = None
        if stream:
            return self._stream(request_id)
        reply = self._read(request_id)
        if reply.get("type") != "done":
            raise self._unexpected(reply)
        self.last_done = reply
        return reply

    def health(self) -> dict[str, Any]:
        """The daemon's `health` line: status, model, busy, queue_depth, uptime_s."""
        reply = self._read(self._send({"op": "health"}))
        if reply.get("type") != "health":
            raise self._unexpected(reply)
        return reply

    def close(self) -> None:
        self._pending = False
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------

    def _open(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._file = sock.makefile("rb")

    def _send(self, request: dict[str, Any]) -> int:
        request_id = next(self._ids)
        line = json.dumps({**request, "id": request_id}, ensure_ascii=False, allow_nan=False)
        if self._pending:
            # An earlier stream was left unread: its lines would be taken for this
            # request's replies. Closing makes the daemon drop it; reconnect clean.
            self.close()
        if self._sock is None:
            self._open()
        assert self._sock is not None
        self._sock.sendall(line.encode() + b"\n")
        self._pending = True
        return request_id

    def _read(self, request_id: int) -> dict[str, Any]:
        """The next line for `request_id`; an error line is raised as SfcoreError."""
        assert self._file is not None
        line = self._file.readline()
        if not line.endswith(b"\n"):
            self.close()
            raise ConnectionError("the daemon closed the connection")
        reply: dict[str, Any] = json.loads(line)
        kind = reply.get("type")
        if kind == "error":
            self._pending = False
            # Errors sent before any request is read (too_many_connections, forbidden)
            # carry an id of the daemon's own, so an error is raised whatever its id.
            if reply.get("code") in _CLOSING_CODES:
                self.close()
            raise SfcoreError(str(reply.get("code")), str(reply.get("message")))
        if reply.get("id") != request_id:
            raise self._unexpected(reply)
        if kind != "token":
            self._pending = False
        return reply

    def _stream(self, request_id: int) -> Iterator[str]:
        try:
            while True:
                reply = self._read(request_id)
                kind = reply.get("type")
                if kind == "token":
                    yield reply["text"]
                elif kind == "done":
                    self.last_done = reply
                    return
                else:
                    raise self._unexpected(reply)
        finally:
            if self._pending:
                # Left early: unread lines would be taken for the next request's replies.
                self.close()

    def _unexpected(self, reply: dict[str, Any]) -> ConnectionError:
        self.close()
        return ConnectionError(f"unexpected reply from the daemon: {reply!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stream a completion from the sfcore-ai daemon.")
    parser.add_argument("prompt")
    parser.add_argument("--socket", default=DEFAULT_SOCKET_PATH, metavar="PATH",
                        help=f"daemon socket (default {DEFAULT_SOCKET_PATH})")
    parser.add_argument("--max-tokens", type=int, metavar="N")
    parser.add_argument("--temperature", type=float, metavar="T")
    parser.add_argument("--seed", type=int, metavar="N")
    args = parser.parse_args(argv)
    try:
        with Client(args.socket) as client:
            for piece in client.generate(args.prompt, max_tokens=args.max_tokens,
                                         temperature=args.temperature, seed=args.seed):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
    except SfcoreError as exc:
        print(f"sfcore_client: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sfcore_client: {args.socket}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
