"""A request's logprobs on their way from the decode thread's numbers to its lines.

Each token's entry rides with the first line whose text includes the token's first
character: the line of the token itself, or a later one when the token's text was held
back (a UTF-8 character split over tokens, the start of a possible stop sequence), or,
for a token that adds no character of its own (an empty piece, the lead bytes of a
character the next token completes), the line of the next character. Tokens whose text
a stop sequence cut entirely get no entry; at an end without one, the entries no line
took (bytes that never formed a character) go with `done`. Event loop only.
"""

from __future__ import annotations

from collections import deque

from sfcore_daemon.core.result import TokenLogprob, TopLogprob
from sfcore_daemon.core.textstream import TextStream
from sfcore_daemon.llama.logprobs import TokenLogprobs


class LogprobTrail:
    """The entries of one request's tokens, each kept until a line takes it."""

    __slots__ = ("_emitted", "_numbers", "_waiting")

    def __init__(self, numbers: deque[TokenLogprobs]) -> None:
        # The job's numbers, one per piece in order (Job.numbers).
        self._numbers = numbers
        # (the decoded character its text starts at, its bytes, its numbers)
        self._waiting: deque[tuple[int, bytes, TokenLogprobs]] = deque()
        self._emitted = 0  # characters of text emitted so far

    def feed(self, text_stream: TextStream, piece: bytes) -> tuple[str, list[TokenLogprob]]:
        """`TextStream.feed` for the next piece: the text now safe to emit, and the
        entries its line carries (none without text)."""
        start = text_stream.decoded
        text = text_stream.feed(piece)
        self._waiting.append((start, piece, self._numbers.popleft()))
        return text, self.emitted(len(text)) if text else []

    def emitted(self, count: int) -> list[TokenLogprob]:
        """`count` more characters go out in a line: the entries that line carries."""
        self._emitted += count
        emitted, waiting = self._emitted, self._waiting
        entries = []
        while waiting and waiting[0][0] < emitted:
            _, piece, numbers = waiting.popleft()
            entries.append(entry(piece, numbers))
        return entries

    def rest(self) -> list[TokenLogprob]:
        """The entries no line took (the generation ended without a stop sequence)."""
        entries = [entry(piece, numbers) for _, piece, numbers in self._waiting]
        self._waiting.clear()
        return entries


def entry(piece: bytes, numbers: TokenLogprobs) -> TokenLogprob:
    """One token's entry: its bytes and logprob, and its alternatives'."""
    return TokenLogprob(
        token=numbers.token,
        text=piece.decode("utf-8", "replace"),
        bytes=list(piece),
        logprob=numbers.logprob,
        top_logprobs=[
            TopLogprob(token=token, text=alt.decode("utf-8", "replace"), bytes=list(alt),
                       logprob=logprob)
            for token, logprob, alt in zip(numbers.top_ids, numbers.top_logprobs,
                                           numbers.top_pieces, strict=True)],
    )
