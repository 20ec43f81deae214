"""`truncation: "auto"`: a conversation too long for the context loses its oldest
messages until its prompt fits, with room left for the answer.

The instructions (the system message they become) are always kept, and so is the last
message (the turn's new input). A cut falls before a user message (a turn's start), or
failing that before any message but a tool result (never one without its call). The prompt is
counted as admission renders it (`Admission.prompt_tokens`); the cut is the first one
that fits, found by bisection, so a long conversation is rendered a few times, not once
per message. With `"disabled"` (the default) nothing is dropped, and a prompt that does
not fit is the context error it always was.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import msgspec

from sfcore_daemon.core.admission import Refused
from sfcore_daemon.core.request import ChatRequest, Message
from sfcore_daemon.httpd.api import ApiHost
from sfcore_daemon.httpd.errors import ApiError

log = logging.getLogger(__name__)


class Fitted(NamedTuple):
    request: ChatRequest
    conversation: list[Message]
    dropped: int  # messages dropped from the conversation's start


async def fit(host: ApiHost, request: ChatRequest, conversation: list[Message],
              max_output_tokens: int | None) -> Fitted:
    """`request` with the fewest of its oldest `conversation` messages dropped that
    leaves its prompt room for the answer (up to a quarter of the context); unchanged
    if it fits, or if nothing can be dropped to make it fit (admission refuses it)."""
    state = host.state
    n_ctx = (await state.loaded_engine()).n_ctx
    wanted = max_output_tokens or state.config.generation.max_tokens
    limit = n_ctx - min(wanted, n_ctx // 4)
    system = request.messages[:len(request.messages) - len(conversation)]

    def cut_at(cut: int) -> ChatRequest:
        return msgspec.structs.replace(request, messages=[*system, *conversation[cut:]])

    async def fits(cut: int) -> bool:
        try:
            return await host.admission.prompt_tokens(cut_at(cut)) <= limit
        except Refused as refusal:
            if cut:  # a cut the chat template cannot render (roles out of turn)
                return False
            raise ApiError.from_code(refusal.code, refusal.message) from None

    if await fits(0):
        return Fitted(request, conversation, 0)
    # At a user message first (a turn's start, as templates want), else before any
    # message but a tool result.
    for allowed in (("user",), ("user", "assistant", "system")):
        cuts = [cut for cut in range(1, len(conversation))
                if conversation[cut].role in allowed]
        low = await _first_fitting(cuts, fits)
        if low < len(cuts):
            break
    else:
        return Fitted(request, conversation, 0)
    cut = cuts[low]
    log.info("response %s: truncation auto dropped the oldest %d of %d messages to fit "
             "the context (model.n_ctx %d)", request.id, cut, len(conversation), n_ctx)
    return Fitted(cut_at(cut), conversation[cut:], cut)


async def _first_fitting(cuts: list[int], fits: Callable[[int], Awaitable[bool]]) -> int:
    """The index of the first cut that fits, by bisection (fewer messages, fewer
    tokens); len(cuts) if none does."""
    low, high = 0, len(cuts)
    while low < high:
        middle = (low + high) // 2
        if await fits(cuts[middle]):
            high = middle
        else:
            low = middle + 1
    return low
