"""What the blocking and the asyncio client share: results, errors, requests, reply routing.

Replies on a connection come in the order the requests were sent, so each connection keeps
a FIFO of the calls in flight; every reply line belongs to the call at its head. `route`
files one parsed line there: a `token` goes to the call's pieces, a final line ends the
call and pops it. No I/O happens here.
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

DEFAULT_SOCKET = "/tmp/sfcore-ai.sock"
DEFAULT_TIMEOUT = 60.0
GENERATION_OPTIONS = frozenset({"max_tokens", "temperature", "top_k", "top_p", "min_p",
                                "repeat_penalty", "seed", "stop", "cache_prompt",
                                "json_schema", "format", "grammar", "speculative",
                                "logprobs", "priority"})
# The ops whose reply is a generation's: token lines (and `queued` lines while a streamed
# request waits for a slot), then `done` or `error`.
GENERATION_OPS = frozenset({"generate", "chat"})
# Chat only: the functions the model may call (docs/protocol.md, Tool calls).
CHAT_OPTIONS = GENERATION_OPTIONS | {"tools", "tool_choice", "parallel_tool_calls"}
TOOL_CHOICE_MODES = frozenset({"auto", "required", "none"})
# Error codes after which the daemon closes the connection (PROTOCOL.md).
CLOSING_CODES = frozenset({"line_too_long", "too_many_connections", "forbidden",
                           "shutting_down"})
# How long leaving a stream early may wait for its `done` and the `cancelled` reply
# before the connection is closed instead (which also stops the generation).
CANCEL_DRAIN_S = 3.0


class SfcoreError(Exception):
    """An `error` line from the daemon (`code`, `message`), or a failure to talk to it."""

    def __init__(self, code: str, message: str, reply: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        #: The daemon's error line as a dict (None when the client raised it itself).
        self.reply = reply


class SfcoreConnectionError(SfcoreError, ConnectionError):
    """The daemon could not be reached, or the connection broke (code "unreachable")."""

    def __init__(self, message: str, code: str = "unreachable") -> None:
        SfcoreError.__init__(self, code, message)


class SfcoreTimeoutError(SfcoreConnectionError, TimeoutError):
    """No reply line within the client's timeout (code "timeout"); the connection is closed."""

    def __init__(self, message: str) -> None:
        SfcoreConnectionError.__init__(self, message, "timeout")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # Speculative decoding: tokens drafted, and those accepted (0 from older daemons).
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Of those, the tokens a json_schema's grammar forced (0 from older daemons).
    forced_drafted_tokens: int = 0
    forced_accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    """Milliseconds, and tokens per second, as the daemon measured them."""

    queued_ms: float
    prompt_ms: float
    prompt_tok_s: float
    first_token_ms: float
    decode_ms: float
    decode_tok_s: float
    total_ms: float
    # Where the cached prompt tokens came from: "slot", "ram" or "disk" (the daemon's
    # prompt store), or "none" ("none" also from daemons older than the store).
    cache_source: str = "none"


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of a token's likeliest alternatives under the model."""

    token: int
    text: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token: its id, text and bytes, its log-probability under the model,
    and (logprobs N > 0) its N likeliest alternatives, best first."""

    token: int
    text: str
    bytes: bytes
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of one of the chat's tools: the daemon's id for it, the function's name, and
    its arguments (a JSON object, valid against the tool's `parameters`)."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_message(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry carries it."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class QueuePosition:
    """A streamed request's place in the daemon's wait queue (a `queued` line): `position`
    1 is the next to start; `queue_depth` requests wait in all."""

    position: int
    queue_depth: int


@dataclass(frozen=True, slots=True)
class Result:
    """A finished generation: the whole text and the figures of the daemon's `done` line."""

    id: str | int
    text: str
    finish_reason: str
    stop_sequence: str | None
    usage: Usage
    timings: Timings
    # A JSON document the daemon closed early to fit max_tokens (finish_reason "stop").
    truncated: bool = False
    # One entry per token when the request asked for `logprobs` (a stop sequence drops
    # those of tokens wholly inside it); None when it did not.
    logprobs: tuple[TokenLogprob, ...] | None = None
    # The calls the answer made (finish_reason "tool_calls"); `text` is what came before.
    tool_calls: tuple[ToolCall, ...] = ()


def resolve_socket_path(path: str | os.PathLike[str] | None) -> str:
    """The argument, else $SFCORE_SOCKET, else the protocol's default."""
    if path is not None:
        return os.fspath(path)
    return os.environ.get("SFCORE_SOCKET") or DEFAULT_SOCKET


def unreachable(path: str, exc: OSError) -> SfcoreConnectionError:
    reason = exc.strerror or str(exc) or type(exc).__name__
    return SfcoreConnectionError(
        f"cannot connect to {path}: {reason} (the sfcore-ai daemon may not be running)")


# [the thread running a cyclic garbage collection right now, or 0]. A finalizer that
# runs inside one must not do I/O: it may have interrupted its own client mid-read.
_collecting = [0]


def _gc_phase(phase: str, info: dict[str, int]) -> None:
    _collecting[0] = threading.get_ident() if phase == "start" else 0


gc.callbacks.append(_gc_phase)


def in_finalizer_context() -> bool:
    """True inside a cyclic garbage collection of this thread, or at interpreter exit."""
    return _collecting[0] == threading.get_ident() or sys.is_finalizing()


_ids = itertools.count(1)


def new_id() -> int:
    """A request id unique within this process (the daemon echoes it on every reply line)."""
    return next(_ids)


def generation_request(op: str, field: str, value: Any, stream: bool,
                       options: dict[str, Any]) -> dict[str, Any]:
    """A generate/chat request; options that are None are left out (the daemon's default)."""
    known = CHAT_OPTIONS if op == "chat" else GENERATION_OPTIONS
    if not options.keys() <= known:
        unknown = ", ".join(sorted(options.keys() - known))
        raise TypeError(f"unknown {op} option(s): {unknown}")
    request = {"op": op, "id": new_id(), field: value, "stream": stream}
    for key, option in options.items():
        if option is not None:
            request[key] = option
    choice = request.get("tool_choice")
    if isinstance(choice, str) and choice not in TOOL_CHOICE_MODES:
        request["tool_choice"] = {"type": "function", "function": {"name": choice}}
    return request


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the wire carries them (ToolCall entries of `tool_calls` as dicts)."""
    wire = []
    for message in messages:
        entry = dict(message)
        calls = entry.get("tool_calls")
        if calls is not None:
            entry["tool_calls"] = [call.to_message() if isinstance(call, ToolCall) else call
                                   for call in calls]
        wire.append(entry)
    return wire


def function_tool(name: str, description: str = "",
                  parameters: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A chat tool in OpenAI's shape: a function `name` (1-64 of A-Z a-z 0-9 _ . -), what
    it does, and a JSON Schema of its arguments object (None: any object)."""
    function: dict[str, Any] = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = dict(parameters)
    return {"type": "function", "function": function}


def assistant_message(result: Result) -> dict[str, Any]:
    """The assistant's turn of `result` for the conversation sent back: its text, and its
    calls when it made any."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        message["tool_calls"] = [call.to_message() for call in result.tool_calls]
    return message


def tool_message(call: ToolCall | str, content: str) -> dict[str, Any]:
    """A tool's result for the call it answers (a ToolCall, or its id)."""
    call_id = call.id if isinstance(call, ToolCall) else call
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def result_of(done: Mapping[str, Any], text: str,
              streamed: Sequence[Mapping[str, Any]] = ()) -> Result:
    """The Result of a `done` line; `streamed`: the logprobs entries of its token lines."""
    entries = done.get("logprobs")
    return Result(
        id=done["id"], text=text, finish_reason=done["finish_reason"],
        stop_sequence=done.get("stop_sequence"), usage=_known(Usage, done["usage"]),
        timings=_known(Timings, done["timings"]),
        truncated=bool(done.get("truncated", False)),
        logprobs=None if entries is None else tuple(
            token_logprob(entry) for entry in (*streamed, *entries)),
        tool_calls=tuple(
            ToolCall(id=call["id"], name=call["function"]["name"],
                     arguments=call["function"]["arguments"])
            for call in done.get("tool_calls") or ()),
    )


def queue_position(reply: Mapping[str, Any]) -> QueuePosition | None:
    """The QueuePosition of a `queued` line; None when its fields are not integers."""
    position, depth = reply.get("position"), reply.get("queue_depth")
    if type(position) is not int or type(depth) is not int:
        return None
    return QueuePosition(position, depth)


def token_logprob(entry: Mapping[str, Any]) -> TokenLogprob:
    """A typed logprobs entry (`bytes` as bytes, from the list of ints on the wire)."""
    return TokenLogprob(
        token=entry["token"], text=entry["text"], bytes=bytes(entry["bytes"]),
        logprob=entry["logprob"],
        top_logprobs=tuple(
            TopLogprob(token=top["token"], text=top["text"], bytes=bytes(top["bytes"]),
                       logprob=top["logprob"])
            for top in entry.get("top_logprobs", ())),
    )


_T = TypeVar("_T")


def _known(kind: type[_T], fields: Mapping[str, Any]) -> _T:
    """`kind` from the fields it knows: a newer daemon may add fields to a reply, and an
    older client must still read it."""
    names = kind.__dataclass_fields__  # type: ignore[attr-defined]
    return kind(**{name: value for name, value in fields.items() if name in names})


class Call:
    """One request in flight on a connection.

    `pieces` receives what the caller has not taken yet: token texts (or, for `raw`
    calls, whole reply dicts; for `watch` calls, streamed generations a Stream iterates,
    also a QueuePosition per `queued` line).
    `parts` keeps every token text for the final Result, and `entries` the token lines'
    logprobs entries (a request that asked for them). A `generation` call ends only with
    `done` or `error`: other lines of its id (`queued`, or a type newer than this client)
    come before its end. `queued` is the last QueuePosition the daemon reported.
    """

    __slots__ = ("id", "raw", "generation", "watch", "queued", "pieces", "parts", "entries",
                 "final", "error", "done", "abandoned", "conn")

    def __init__(self, request_id: Any, raw: bool = False, generation: bool = False,
                 watch: bool = False) -> None:
        self.id = request_id
        self.raw = raw
        self.generation = generation
        self.watch = watch and not raw  # a stream that reports queue positions
        self.queued: QueuePosition | None = None
        self.pieces: deque[Any] = deque()
        self.parts: list[str] = []
        self.entries: list[Mapping[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self.error: SfcoreError | None = None
        self.done = False
        self.abandoned = False  # nobody takes its pieces any more
        self.conn: Any = None  # the connection it was sent on

    def fail(self, error: SfcoreError) -> None:
        if not self.done:
            self.error = error
            self.done = True

    def outcome(self) -> dict[str, Any]:
        """The final reply line; raises the call's error."""
        if self.error is not None:
            raise self.error
        assert self.final is not None
        return self.final


class OutOfStep(Exception):
    """The connection carried something other than the reply the client expects."""


def queued_behind(call: Call) -> bool:
    """The daemon answers a connection's requests in order: while an earlier request is
    unanswered, `call`'s lines come only after that one's (a stream may run for minutes),
    so no deadline for `call` should run yet."""
    calls: deque[Call] = call.conn.calls
    return bool(calls) and calls[0] is not call


def route(calls: deque[Call], reply: Any) -> bool:
    """File one reply line with the call at the head of `calls`.

    Returns True when the daemon is about to close the connection (a closing error code).
    Raises OutOfStep for a line that does not belong to the head call.
    """
    if not calls:
        raise OutOfStep(f"a reply line with no request pending: {str(reply)[:120]}")
    call = calls[0]
    try:
        kind = reply["type"]
        if kind == "token":
            if reply["id"] != call.id:
                raise OutOfStep(f"a token for id {reply['id']!r} while {call.id!r} is due")
            text = reply["text"]
            call.parts.append(text)
            entries = reply.get("logprobs")
            if entries:
                call.entries += entries
            if not call.abandoned:
                call.pieces.append(reply if call.raw else text)
            return False
        if kind == "error":
            # An error the daemon could not attribute (e.g. line_too_long) carries an id
            # it assigned itself; it still answers the head request.
            calls.popleft()
            code = str(reply.get("code"))
            call.error = SfcoreError(code, str(reply.get("message")), reply)
            call.done = True
            return code in CLOSING_CODES
        if reply["id"] != call.id:
            raise OutOfStep(f"a {kind!r} line for id {reply['id']!r} while {call.id!r} is due")
        if call.generation and kind != "done":
            # Not the end: the request's place in the wait queue, or a line of a type newer
            # than this client (skipped; a raw call passes it on as it came).
            if kind == "queued":
                position = queue_position(reply)
                if position is not None:
                    call.queued = position
                    if call.watch and not call.abandoned:
                        call.pieces.append(position)
            if call.raw and not call.abandoned:
                call.pieces.append(reply)
            return False
    except (KeyError, TypeError):
        raise OutOfStep(f"a reply line of an unknown shape: {str(reply)[:120]}") from None
    calls.popleft()
    call.final = reply
    call.done = True
    if call.raw and not call.abandoned:
        call.pieces.append(reply)
    return False
