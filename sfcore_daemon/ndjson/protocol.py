"""The wire protocol: NDJSON messages as msgspec Structs (docs/protocol.md).

Requests are a tagged union on `op`, decoded by one reused typed Decoder; replies
are tagged on `type` and encoded by one reused Encoder. Nothing here touches a
socket: `decode_request` turns one line into a request or a `RequestError`.
"""

from __future__ import annotations

import itertools
import re
from typing import Annotated, Final, Literal, get_args

import msgspec
from msgspec import Meta, Struct

from sfcore_daemon.core.counts import (
    CacheListing,
    EffectiveConfig,
    ModelDescription,
    StatsSnapshot,
    Versions,
)
from sfcore_daemon.core.errors import BAD_JSON, INVALID_REQUEST
from sfcore_daemon.core.request import ChatRequest, GenerateRequest, RequestId
from sfcore_daemon.core.result import Result, TokenLogprob

# --- requests -------------------------------------------------------------------------


class _Request(Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    id: RequestId | None = None


class GenerateOp(GenerateRequest, tag="generate", tag_field="op", forbid_unknown_fields=True,
                 frozen=True, kw_only=True):
    """`generate`: the core's completion request, as the socket carries it."""


class ChatOp(ChatRequest, tag="chat", tag_field="op", forbid_unknown_fields=True,
             frozen=True, kw_only=True):
    """`chat`: the core's chat request, as the socket carries it."""


class TokenizeRequest(_Request, tag="tokenize", kw_only=True):
    text: str
    add_special: bool = True


class DetokenizeRequest(_Request, tag="detokenize", kw_only=True):
    # The upper bound (the vocabulary size) is only known once the model is loaded.
    tokens: list[Annotated[int, Meta(ge=0, le=2**31 - 1)]]


class HealthRequest(_Request, tag="health"):
    pass


class InfoRequest(_Request, tag="info"):
    pass


class StatsRequest(_Request, tag="stats"):
    pass


class CancelRequest(_Request, tag="cancel", kw_only=True):
    target: RequestId


class MetricsRequest(_Request, tag="metrics"):
    pass


class CacheRequest(_Request, tag="cache", kw_only=True):
    # list: what the prompt store holds; clear: forget all of it, RAM and files.
    action: Literal["list", "clear"] = "list"


Request = (GenerateOp | ChatOp | TokenizeRequest | DetokenizeRequest | HealthRequest
           | InfoRequest | StatsRequest | CancelRequest | CacheRequest | MetricsRequest)
GenerationOp = GenerateOp | ChatOp


# --- replies --------------------------------------------------------------------------


class _Reply(Struct, tag_field="type", kw_only=True):
    id: RequestId


# `logprobs` is written only for a request that asks (omit_defaults leaves out None).
class TokenReply(_Reply, tag="token", kw_only=True, omit_defaults=True):
    text: str
    # The tokens whose text starts in this line (docs/protocol.md, Logprobs).
    logprobs: list[TokenLogprob] | None = None


class QueuedReply(_Reply, tag="queued", kw_only=True):
    """A streamed request waits for a slot: `position` 1 starts next."""

    position: int
    queue_depth: int


class DoneReply(Result, tag="done", tag_field="type", kw_only=True, omit_defaults=True):
    """The last line of a generation: the core's result, tagged."""


class ErrorReply(_Reply, tag="error", kw_only=True):
    code: str
    message: str


class HealthReply(_Reply, tag="health", kw_only=True):
    status: Literal["ok", "loading", "draining"]
    model: str
    busy: bool
    queue_depth: int
    uptime_s: float
    # Beyond PROTOCOL.md: decode slots, and how many run a request now.
    slots: int
    slots_busy: int


class TokensReply(_Reply, tag="tokens", kw_only=True):
    tokens: list[int]


class TextReply(_Reply, tag="text", kw_only=True):
    text: str


class CancelledReply(_Reply, tag="cancelled", kw_only=True):
    target: RequestId
    found: bool


class InfoReply(_Reply, tag="info", kw_only=True):
    model: ModelDescription
    config: EffectiveConfig
    system_info: str
    versions: Versions


class CacheReply(CacheListing, tag="cache", tag_field="type", kw_only=True):
    id: RequestId


class StatsReply(StatsSnapshot, tag="stats", tag_field="type", kw_only=True):
    id: RequestId


class MetricsReply(_Reply, tag="metrics", kw_only=True):
    text: str  # Prometheus' text exposition format 0.0.4 (core/metrics.py)


Reply = (TokenReply | QueuedReply | DoneReply | ErrorReply | HealthReply | TokensReply | TextReply
         | CancelledReply | InfoReply | StatsReply | CacheReply | MetricsReply)


# --- decoding -------------------------------------------------------------------------

_request_decoder: Final = msgspec.json.Decoder(Request)
# `op` may be left out and then means "generate"; msgspec has no default tag, so a
# request without one is decoded again as the generate Struct.
_generate_decoder: Final = msgspec.json.Decoder(GenerateOp)
_any_decoder: Final = msgspec.json.Decoder()
_MISSING_OP: Final = "Object missing required field `op`"
_INVALID_TAG = re.compile(r"^Invalid value '(?P<op>.*)' - at `\$\.op`$")
KNOWN_OPS: Final = tuple(str(t.__struct_config__.tag) for t in get_args(Request))

# msgspec rejects NaN/Infinity literals, lone surrogates and numbers out of range
# itself; invalid UTF-8 surfaces as UnicodeDecodeError, deep nesting may recurse.
_MALFORMED: Final = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)

_assigned_ids = itertools.count(1)


def assign_id() -> str:
    """An id for a request that came without one: unique within this process."""
    return f"sfc-{next(_assigned_ids)}"


class RequestError(Exception):
    def __init__(self, code: str, message: str, request_id: RequestId | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


def op_name(request: Request) -> str:
    return str(type(request).__struct_config__.tag)


def decode_request(line: bytes) -> Request:
    """Decode one NDJSON line; raise RequestError (bad_json / invalid_request) if it is wrong.

    The returned request always has an id (the client's, or an assigned one).
    """
    try:
        try:
            request: Request = _request_decoder.decode(line)
        except msgspec.ValidationError as exc:
            if str(exc) != _MISSING_OP:
                raise
            request = _generate_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise _classify_invalid(line, exc) from None
    except _MALFORMED as exc:
        raise RequestError(BAD_JSON, f"not valid JSON: {_malformed_reason(exc)}") from None
    if request.id is None:
        request = msgspec.structs.replace(request, id=assign_id())
    return request


def _classify_invalid(line: bytes, exc: msgspec.ValidationError) -> RequestError:
    """A typed decode failed: tell bad JSON from a well-formed but invalid request.

    The typed decoder stops at the first field of the wrong type, so the line may
    still be malformed further on; parsing it untyped settles which error it is,
    and recovers the client's id for the error line.
    """
    try:
        document = _any_decoder.decode(line)
    except _MALFORMED as bad:
        return RequestError(BAD_JSON, f"not valid JSON: {_malformed_reason(bad)}")
    if not isinstance(document, dict):
        return RequestError(BAD_JSON, f"not a JSON object (got {type(document).__name__})")
    request_id = document.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, str | int):
        request_id = None
    message = str(exc)
    if match := _INVALID_TAG.match(message):
        known = ", ".join(sorted(KNOWN_OPS))
        message = f"unknown op {match['op']!r} (known: {known}) - at `$.op`"
    return RequestError(INVALID_REQUEST, message, request_id)


def _malformed_reason(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"invalid UTF-8 at byte {exc.start}"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc)


# --- encoding -------------------------------------------------------------------------

_encoder: Final = msgspec.json.Encoder()


def encode_line(reply: Reply) -> bytes:
    return _encoder.encode(reply) + b"\n"


def encode_line_into(reply: Reply, buffer: bytearray) -> None:
    """Append one reply line to `buffer` (one allocation-free step per streamed token)."""
    _encoder.encode_into(reply, buffer, -1)
    buffer.extend(b"\n")


def error_line(request_id: RequestId, code: str, message: str) -> bytes:
    return encode_line(ErrorReply(id=request_id, code=code, message=message))
