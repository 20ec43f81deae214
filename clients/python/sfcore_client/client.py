"""The blocking client: one Unix socket connection, requests answered in order."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from ._common import (
    Result,
    SfcoreConnectionError,
    SfcoreError,
    decode,
    encode,
    generation_request,
    new_id,
    result_of,
    socket_path,
    unreachable,
)

# How long leaving a stream early may spend draining it (cancel, then its `done`).
_CANCEL_DRAIN_S = 5.0


class Client:
    """A blocking client. Connects lazily, and again after a connection was given up."""

    def __init__(self, socket_path_: str | os.PathLike[str] | None = None, *,
                 timeout: float | None = 120.0) -> None:
        self.socket_path = socket_path(socket_path_)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._reader: Any = None
        self._lock = threading.RLock()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._reader = None

    # --- one-line ops ---

    def health(self) -> dict[str, Any]:
        return self._call({"op": "health"})

    def info(self) -> dict[str, Any]:
        return self._call({"op": "info"})

    def stats(self) -> dict[str, Any]:
        return self._call({"op": "stats"})

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        tokens: list[int] = self._call({"op": "tokenize", "text": text,
                                        "add_special": add_special})["tokens"]
        return tokens

    def detokenize(self, tokens: Sequence[int]) -> str:
        text: str = self._call({"op": "detokenize", "tokens": list(tokens)})["text"]
        return text

    def cancel(self, target: str | int) -> bool:
        """Cancel a request sent earlier on this client's connection; True if it was pending."""
        return bool(self._call({"op": "cancel", "target": target})["found"])

    # --- generations ---

    def generate(self, prompt: str, **options: Any) -> Result:
        return self._complete(generation_request("generate", {"prompt": prompt}, False, options))

    def chat(self, messages: Sequence[dict[str, str]], **options: Any) -> Result:
        return self._complete(generation_request("chat", {"messages": list(messages)}, False,
                                                 options))

    def stream_generate(self, prompt: str, **options: Any) -> Stream:
        return Stream(self, generation_request("generate", {"prompt": prompt}, True, options))

    def stream_chat(self, messages: Sequence[dict[str, str]], **options: Any) -> Stream:
        return Stream(self, generation_request("chat", {"messages": list(messages)}, True,
                                               options))

    # --- plumbing ---

    def _complete(self, request: dict[str, Any]) -> Result:
        with self._lock:
            self._send(request)
            done = self._read()
        return result_of(done, done["text"])

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        request.setdefault("id", new_id())
        with self._lock:
            self._send(request)
            return self._read()

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise unreachable(self.socket_path, exc) from None
        self._sock = sock
        self._reader = sock.makefile("rb")

    def _send(self, request: dict[str, Any]) -> None:
        if self._sock is None:
            self._connect()
        assert self._sock is not None
        try:
            self._sock.sendall(encode(request))
        except OSError as exc:
            self.close()
            raise SfcoreConnectionError(
                f"lost the connection to {self.socket_path}: {exc}") from None

    def _read(self) -> dict[str, Any]:
        """The next reply line; an `error` line raises SfcoreError."""
        try:
            line = self._reader.readline()
        except OSError as exc:  # a timeout included: the connection is out of step now
            self.close()
            raise SfcoreConnectionError(
                f"reading from {self.socket_path} failed: {exc}") from None
        if not line:
            self.close()
            raise SfcoreConnectionError(
                f"the daemon closed the connection ({self.socket_path})") from None
        return decode(line)


class Stream:
    """Text pieces of one streamed generation; `result` once it has finished.

    Leaving early (break, an exception, `close()`) cancels the generation on the
    daemon and drains it, so the connection stays usable; if that fails, or the
    stream is garbage-collected unfinished, the connection is closed instead,
    which also frees the daemon's slot within a token.
    """

    def __init__(self, client: Client, request: dict[str, Any]) -> None:
        self._client = client
        self.id = request["id"]
        self.result: Result | None = None
        self._parts: list[str] = []
        self._started = False
        self._cancel_sent = False
        self._request = request

    def __iter__(self) -> Iterator[str]:
        return self._pieces()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _pieces(self) -> Iterator[str]:
        client = self._client
        client._lock.acquire()
        try:
            client._send(self._request)
            self._started = True
            while True:
                reply = client._read()
                if reply["type"] == "token":
                    self._parts.append(reply["text"])
                    yield reply["text"]
                elif reply["type"] == "done":
                    self.result = result_of(reply, "".join(self._parts))
                    if self._cancel_sent:  # its `cancelled` line follows the `done`
                        while client._read()["type"] != "cancelled":
                            pass
                    return
        except GeneratorExit:
            self._abandon()
            raise
        finally:
            client._lock.release()

    def cancel(self) -> None:
        """Ask the daemon to stop this generation; iteration then ends with a `cancelled` result."""
        sock = self._client._sock
        if sock is not None and self._started and self.result is None:
            sock.sendall(encode({"op": "cancel", "id": new_id(), "target": self.id}))
            self._cancel_sent = True

    def close(self) -> None:
        if self._started and self.result is None:
            self._abandon()

    def _abandon(self) -> None:
        client = self._client
        if client._sock is None or self.result is not None:
            return
        try:
            client._sock.settimeout(_CANCEL_DRAIN_S)
            if not self._cancel_sent:
                client._sock.sendall(encode({"op": "cancel", "id": new_id(),
                                             "target": self.id}))
            while (reply := client._read())["type"] != "cancelled":
                if reply["type"] == "done":
                    self.result = result_of(reply, "".join(self._parts))
            client._sock.settimeout(client.timeout)
        except (OSError, SfcoreError):
            client.close()

    def __del__(self) -> None:
        # No I/O in a finalizer: closing the socket is enough for the daemon.
        if self._started and self.result is None and self._client._sock is not None:
            self._client.close()


__all__ = ["Client", "Stream"]
