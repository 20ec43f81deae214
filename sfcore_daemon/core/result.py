"""What a generation streams back and the result it ends with."""

from __future__ import annotations

from typing import Final, Literal, get_args

from msgspec import Struct

from sfcore_daemon.core.request import RequestId, ToolCall

FinishReason = Literal["stop", "stop_sequence", "length", "cancelled", "tool_calls"]
FINISH_REASONS: Final = get_args(FinishReason)


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


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    # Of the prompt: tokens whose state was reused (a slot's cells, a stored state), and
    # tokens after those whose state this request stored for a cache mark.
    cached_tokens: int
    completion_tokens: int
    # Tokens proposed by speculative decoding, and how many of them were emitted; of
    # those, the tokens a json_schema's grammar forced (docs/protocol.md).
    drafted_tokens: int
    accepted_tokens: int
    forced_drafted_tokens: int = 0
    forced_accepted_tokens: int = 0
    cache_write_tokens: int = 0


class SamplerSettings(Struct, kw_only=True):
    """The sampler a reply was drawn with: the request's values, else the config's."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    frequency_penalty: float
    presence_penalty: float


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


class Result(Struct, kw_only=True, omit_defaults=True):
    """How a generation ended: its whole text, why it stopped, its counts."""

    id: RequestId

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
    # What gives this reply again (docs/protocol.md, done): the model, build and kernels,
    # the sampler, and a sampled reply's seed (the request's or one drawn for it).
    model_fingerprint: str = ""
    sampler: SamplerSettings | None = None
    seed: int | None = None

    @property
    def cut_short(self) -> bool:
        """The answer ended before the model ended it: max_tokens, a document closed
        early to fit them, or a stopping daemon (never an answer that made calls)."""
        return not self.tool_calls and (
            self.truncated or self.finish_reason in ("length", "cancelled"))
