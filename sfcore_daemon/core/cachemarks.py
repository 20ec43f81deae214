"""Cache marks (`ChatRequest.cache_marks`, Anthropic's `cache_control`): where each
mark's prefix ends in the rendered prompt, as a count of its segments (chat.py).

A mark ends at its message's text: the template's markup after it belongs to the next
turn, which the next request may render otherwise (its generation prompt, say). The
system message is the exception: a mark there also takes the markup up to the next
message's text, where templates write tool definitions, so a mark on the system
prompt or on a tool (`message` -1) covers them as Anthropic's prefix order does. Each
segment is tokenized on its own (llama/model.py), so a segment boundary is a token
boundary and the prefix's tokens are exactly the prompt's first ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from sfcore_daemon.core.chat import Segment
from sfcore_daemon.core.request import CacheMark


def segment_cuts(marks: Sequence[CacheMark], origins: Sequence[int], roles: Sequence[str],
                 ends: Sequence[int], segments: Sequence[Segment]) -> dict[int, int]:
    """{segments the prefix spans: the longest TTL of the marks ending there} for
    `marks` over a request's messages. `origins`: each request message's index among
    the rendered messages, whose `roles` and `ends` (ChatTemplate.render) are given.
    A mark on a message the template did not render, or on an empty prefix, is left
    out."""
    cuts: dict[int, int] = {}
    for mark in marks:
        cut = _cut(mark.message, origins, roles, ends, segments)
        if cut > 0:
            cuts[cut] = max(cuts.get(cut, 0), mark.ttl_s)
    return cuts


def _cut(message: int, origins: Sequence[int], roles: Sequence[str], ends: Sequence[int],
         segments: Sequence[Segment]) -> int:
    if message >= len(origins) or not roles:
        return 0
    if message < 0:
        if roles[0] != "system":
            # The first turn's opening markup, whatever it holds (tool definitions).
            return next((at for at, (_, content) in enumerate(segments) if content), 0)
        rendered = 0
    else:
        rendered = origins[message]
    if not 0 <= rendered < len(ends):
        return 0
    cut = ends[rendered]
    if cut < 0:
        return 0
    if roles[rendered] == "system":
        while cut < len(segments) and not segments[cut][1]:
            cut += 1
    return cut
