"""What the blocking and the asyncio client share: results, errors, request building."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_SOCKET = "/tmp/sfcore-ai.sock"
# The single or last line of a reply: everything but a streamed `token`.
FINAL_TYPES = frozenset({"done", "error", "health", "info", "stats", "tokens", "text",
                         "cancelled"})
GENERATION_OPTIONS = ("max_tokens", "temperature", "top_k", "top_p", "min_p",
                      "repeat_penalty", "seed", "stop", "cache_prompt")


class SfcoreError(Exception):
    """An `error` line from the daemon (`code`, `message`), or a failure to reach it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SfcoreConnectionError(SfcoreError, ConnectionError):
    """The daemon could not be reached, or the connection broke."""

    def __init__(self, message: str) -> None:
        SfcoreError.__init__(self, "unreachable", message)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    queued_ms: float
    prompt_ms: float
    prompt_tok_s: float
    first_token_ms: float
    decode_ms: float
    decode_tok_s: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class Result:
    """A finished generation: the whole text and the daemon's `done` figures."""

    id: str | int
    text: str
    finish_reason: str
    stop_sequence: str | None
    usage: Usage
    timings: Timings


def socket_path(path: str | os.PathLike[str] | None) -> str:
    """The argument, else $SFCORE_SOCKET, else the protocol's default."""
    if path is not None:
        return os.fspath(path)
    return os.environ.get("SFCORE_SOCKET") or DEFAULT_SOCKET


def unreachable(path: str, exc: OSError) -> SfcoreConnectionError:
    reason = exc.strerror or str(exc)
    return SfcoreConnectionError(
        f"cannot connect to {path}: {reason} (is the sfcore-ai daemon running?)")


_ids = itertools.count(1)


def new_id() -> int:
    return next(_ids)


def generation_request(op: str, body: dict[str, Any], stream: bool,
                       options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(options) - set(GENERATION_OPTIONS)
    if unknown:
        raise TypeError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
    request = {"op": op, "id": new_id(), **body, "stream": stream}
    request.update((key, value) for key, value in options.items() if value is not None)
    return request


def encode(request: dict[str, Any]) -> bytes:
    return json.dumps(request, ensure_ascii=False).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    try:
        reply: dict[str, Any] = json.loads(line)
    except ValueError:
        raise SfcoreConnectionError(
            f"the daemon sent a line that is not JSON: {line[:80]!r}") from None
    if reply.get("type") == "error":
        raise SfcoreError(str(reply.get("code")), str(reply.get("message")))
    return reply


def result_of(done: dict[str, Any], text: str) -> Result:
    return Result(
        id=done["id"], text=text, finish_reason=done["finish_reason"],
        stop_sequence=done.get("stop_sequence"), usage=Usage(**done["usage"]),
        timings=Timings(**done["timings"]),
    )
