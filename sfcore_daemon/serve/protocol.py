"""The wire protocol: NDJSON messages as msgspec Structs (docs/protocol.md).

Requests are a tagged union on `op`, decoded by one reused typed Decoder; replies
are tagged on `type` and encoded by one reused Encoder. Nothing here touches a
socket: `decode_request` turns one line into a request or a `RequestError`.
"""

from __future__ import annotations

import itertools
import re
from typing import Annotated, Any, Final, Literal, get_args

import msgspec
from msgspec import Meta, Struct

RequestId = str | int

# Error codes of PROTOCOL.md.
BAD_JSON: Final = "bad_json"
INVALID_REQUEST: Final = "invalid_request"
CONTEXT_OVERFLOW: Final = "context_overflow"
QUEUE_FULL: Final = "queue_full"
LINE_TOO_LONG: Final = "line_too_long"
TOO_MANY_CONNECTIONS: Final = "too_many_connections"
FORBIDDEN: Final = "forbidden"
SHUTTING_DOWN: Final = "shutting_down"
INTERNAL: Final = "internal"
# A request's grammar allows no token to continue its document: that request ends alone.
GRAMMAR_DEAD_END: Final = "grammar_dead_end"

ERROR_CODES: Final = (BAD_JSON, INVALID_REQUEST, CONTEXT_OVERFLOW, QUEUE_FULL, LINE_TOO_LONG,
                      TOO_MANY_CONNECTIONS, FORBIDDEN, SHUTTING_DOWN, INTERNAL, GRAMMAR_DEAD_END)

FinishReason = Literal["stop", "stop_sequence", "length", "cancelled", "tool_calls"]
FINISH_REASONS: Final = get_args(FinishReason)

StopText = Annotated[str, Meta(min_length=1)]
# Bounds past the protocol's "int >= 0" / "float >= 0" keep values that llama.cpp
# takes as C ints finite and unwrapped; they are far beyond any useful setting.
CInt = Annotated[int, Meta(ge=0, le=2**31 - 1)]
# The most alternatives a token's logprobs may list (OpenAI's top_logprobs limit).
MAX_LOGPROBS: Final = 20


# --- requests -------------------------------------------------------------------------


class _Request(Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    id: RequestId | None = None


class _GenerationOptions(_Request):
    """Fields shared by every op that runs the model (generate, chat)."""

    stream: bool = True
    max_tokens: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=1e6)] | None = None
    top_k: CInt | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Meta(gt=0, le=1e6)] | None = None
    # OpenAI's: subtracted from a recent token's logit per use, and once if used at all.
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    seed: Annotated[int, Meta(ge=0)] | None = None
    stop: StopText | Annotated[list[StopText], Meta(max_length=8)] | None = None
    cache_prompt: bool = True
    # Structured output, at most one of them (see grammar.py): a JSON Schema the output
    # must be valid against, any JSON object, or a GBNF grammar.
    json_schema: dict[str, Any] | None = None
    format: Literal["json"] | None = None
    grammar: Annotated[str, Meta(min_length=1)] | None = None
    # false: never draft tokens for this request (see speculative.py); the output is
    # the same either way, only its speed differs.
    speculative: bool = True
    # Each token's log-probability and its `logprobs` likeliest alternatives (0: the
    # token's own only); None: none. OpenAI's top_logprobs has the same range.
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(dict.fromkeys(self.stop))


class GenerateRequest(_GenerationOptions, tag="generate", kw_only=True):
    prompt: Annotated[str, Meta(min_length=1)]


# A function's name as OpenAI allows it (it is also what a call must name exactly).
# msgspec matches with re.search: `\Z`, since `$` also matches before a final newline.
ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}\Z")]
# Tools one request may offer; each is a JSON Schema compiled into the call's grammar.
MAX_TOOLS: Final = 64


class FunctionCall(Struct, forbid_unknown_fields=True, kw_only=True):
    """A call of a function: its name and its arguments (a JSON object)."""

    name: ToolName
    arguments: dict[str, Any]


class ToolCall(Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    # An assistant's earlier calls (docs/protocol.md, Tool calls).
    tool_calls: Annotated[list[ToolCall], Meta(max_length=64)] | None = None
    # A tool message: the call it answers.
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None


class FunctionSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    name: ToolName
    description: str = ""
    # JSON Schema of the arguments object; None: any object.
    parameters: dict[str, Any] | None = None
    # OpenAI's flag; the arguments always validate here, so it changes nothing.
    strict: bool | None = None


class Tool(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(Struct, forbid_unknown_fields=True, kw_only=True):
    name: ToolName


class ChosenTool(Struct, forbid_unknown_fields=True, kw_only=True):
    """`tool_choice` naming one function: the answer is one call of it."""

    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | ChosenTool


class ChatRequest(_GenerationOptions, tag="chat", kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    # None: "auto" when tools are given.
    tool_choice: ToolChoice | None = None
    # false: one call at most per answer.
    parallel_tool_calls: bool = True


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


Request = (GenerateRequest | ChatRequest | TokenizeRequest | DetokenizeRequest | HealthRequest
           | InfoRequest | StatsRequest | CancelRequest | CacheRequest | MetricsRequest)
GenerationRequest = GenerateRequest | ChatRequest


# --- replies --------------------------------------------------------------------------


class _Reply(Struct, tag_field="type", kw_only=True):
    id: RequestId


class TopLogprob(Struct, kw_only=True):
    """One of a token's likeliest alternatives (the chosen one among them)."""

    token: int
    text: str  # its bytes as UTF-8, invalid sequences replaced (U+FFFD)
    bytes: list[int]
    logprob: float


class TokenLogprob(Struct, kw_only=True):
    """A generated token's log-probability under the model (docs/protocol.md)."""

    token: int
    text: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]  # best first; [] for logprobs 0


# `logprobs` is written only for a request that asks (omit_defaults leaves out None).
class TokenReply(_Reply, tag="token", kw_only=True, omit_defaults=True):
    text: str
    # The tokens whose text starts in this line (docs/protocol.md, Logprobs).
    logprobs: list[TokenLogprob] | None = None


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # Tokens proposed by speculative decoding, and how many of them were emitted; of
    # those, the tokens a json_schema's grammar forced (docs/protocol.md).
    drafted_tokens: int
    accepted_tokens: int
    forced_drafted_tokens: int = 0
    forced_accepted_tokens: int = 0


class Timings(Struct, kw_only=True):
    queued_ms: float
    prompt_ms: float
    prompt_tok_s: float
    first_token_ms: float
    decode_ms: float
    decode_tok_s: float
    total_ms: float
    # Where the cached prompt rows came from: "slot" (cells a slot still held),
    # "ram" or "disk" (a stored state restored), or "none".
    cache_source: Literal["none", "slot", "ram", "disk"]


class DoneReply(_Reply, tag="done", kw_only=True, omit_defaults=True):
    text: str
    finish_reason: FinishReason
    stop_sequence: str | None
    # A JSON document closed early to fit max_tokens (finish_reason "stop").
    truncated: bool
    usage: Usage
    timings: Timings
    # Asked for: every token's entry (stream false), else those no token line carried.
    logprobs: list[TokenLogprob] | None = None
    # The calls the answer made (finish_reason "tool_calls"); `text` is what came before.
    tool_calls: list[ToolCall] | None = None


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


class ModelDescription(Struct, kw_only=True):
    path: str
    name: str
    architecture: str
    n_params: int
    n_ctx_train: int
    n_vocab: int
    size_bytes: int
    has_chat_template: bool


class EffectiveConfig(Struct, kw_only=True):
    n_ctx: int
    threads: int
    threads_batch: int
    batch: int
    ubatch: int
    cpu_affinity: list[int]
    mmap: bool
    mlock: bool
    # Bytes of the load's memory (weights unless mmap, KV cache, buffers) collapsed into
    # 2 MiB pages at start-up; 0 where huge_pages is off or the kernel refused.
    huge_page_bytes: int
    gpu_layers: int
    flash_attn: bool | str
    reproducible: bool
    slots: int
    prefill_per_step: int
    speculative: SpeculativeSettings
    cache: CacheSettings
    # Which template `chat` renders: "model" (the GGUF's own), a llama.cpp built-in
    # name, "jinja" (a configured template text), or None (chat is unavailable).
    chat_template: str | None


class SpeculativeSettings(Struct, kw_only=True):
    mode: Literal["ngram", "off"]
    draft_max: int
    draft_start: int
    ngram_max: int
    ngram_min: int
    store_tokens: int
    row_multiple: int
    policy: Literal["measured", "always"]
    # With "measured": each step size's cost in one-row steps, as drafts are judged.
    step_costs: dict[int, float] | None


class CacheSettings(Struct, kw_only=True):
    enabled: bool  # false also in reproducible mode
    dir: str | None  # the disk tier's folder; None without one
    ram_mb: int
    disk_mb: int
    min_tokens: int


class Versions(Struct, kw_only=True):
    sfcore: str
    llama_cpp_python: str
    llama_cpp: str


class InfoReply(_Reply, tag="info", kw_only=True):
    model: ModelDescription
    config: EffectiveConfig
    system_info: str
    versions: Versions


class RequestCounts(Struct, kw_only=True):
    total: int
    by_op: dict[str, int]
    by_outcome: dict[str, int]


class TokenCounts(Struct, kw_only=True):
    prompt: int
    cached: int
    generated: int


class ConnectionCounts(Struct, kw_only=True):
    current: int
    total: int
    rejected: int


class HttpCounts(Struct, kw_only=True):
    """The OpenAI listener's connections and replies."""

    current: int  # open now
    total: int  # accepted since start
    closed: dict[str, int]  # closed by the daemon, by why (stats.HTTP_CLOSED)
    responses: dict[str, int]  # replies by HTTP status, "200" ... "503"


class SlotUse(Struct, kw_only=True):
    slot: int
    busy: bool
    requests: int  # requests started on this slot since start
    cached_tokens: int  # tokens an idle slot holds for prefix reuse


class GrammarCounts(Struct, kw_only=True):
    requests: int
    tokens: int
    resampled: int
    closed_early: int  # JSON documents closed early to fit max_tokens


class SpeculativeCounts(Struct, kw_only=True):
    requests: int  # generations that drafted at least one token
    drafted: int
    accepted: int
    steps: int  # a generation's steps with a draft, summed over generations
    aligned_steps: int  # of those, the steps with a multiple of row_multiple logit rows
    logit_rows: int  # the logit rows of those steps, as submitted
    # Of drafted and accepted: the tokens a json_schema's grammar forced.
    forced_drafted: int = 0
    forced_accepted: int = 0


class ThreadCounts(Struct, kw_only=True):
    decode: int  # decode threads in force now
    batch: int  # batch threads in force now
    configured: int  # decode threads on an idle machine ([runtime] n_threads)
    adaptive: bool  # [runtime] adaptive_threads
    changes: int  # times the counts changed since start


class CacheCounts(Struct, kw_only=True):
    enabled: bool
    # Generations whose prompt prefix came from each source, and the rows restored
    # from stored states (RAM and disk).
    hits: dict[str, int]
    restored_tokens: int
    saved: int  # states taken from slots into the store
    written: int  # state files written
    ram_bytes: int
    ram_states: int
    disk_bytes: int
    disk_files: int
    ram_evicted: int
    disk_evicted: int
    errors: int  # damaged, foreign or unreadable files, failed writes and restores


class StoredState(Struct, kw_only=True):
    tokens: int  # the prefix's length; a prompt that starts with it restores it
    bytes: int  # the state's size (in RAM; its file adds a header)
    ram: bool
    disk: bool
    preview: str  # the start of its text


class CacheReply(_Reply, tag="cache", kw_only=True):
    enabled: bool
    dir: str | None  # the disk tier's folder (this model and build's); None without one
    states: list[StoredState]  # most recently used first; [] after a clear
    removed_states: int  # by a clear: states forgotten (RAM and disk)
    removed_files: int  # by a clear: files removed from `dir`
    removed_bytes: int


class StatsReply(_Reply, tag="stats", kw_only=True):
    uptime_s: float
    requests: RequestCounts
    tokens: TokenCounts
    errors: dict[str, int]
    connections: ConnectionCounts
    http: HttpCounts
    decode_tok_s: float
    slots: list[SlotUse]
    grammar: GrammarCounts
    speculative: SpeculativeCounts
    cache: CacheCounts
    threads: ThreadCounts


class MetricsReply(_Reply, tag="metrics", kw_only=True):
    text: str  # Prometheus' text exposition format 0.0.4 (serve/metrics.py)


Reply = (TokenReply | DoneReply | ErrorReply | HealthReply | TokensReply | TextReply
         | CancelledReply | InfoReply | StatsReply | CacheReply | MetricsReply)


# --- decoding -------------------------------------------------------------------------

_request_decoder: Final = msgspec.json.Decoder(Request)
# `op` may be left out and then means "generate"; msgspec has no default tag, so a
# request without one is decoded again as the generate Struct.
_generate_decoder: Final = msgspec.json.Decoder(GenerateRequest)
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
        request.id = assign_id()
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
