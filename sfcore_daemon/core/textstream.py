"""Turn the model's token pieces (raw bytes) into the text a client may see.

Two things are held back, and only for as long as needed:
- the bytes of a UTF-8 character split across tokens, until it is complete
  (bytes that can never complete one, mid-stream or at the end, are dropped);
- the tail of the text that could still grow into a stop sequence.
Everything else is released at once, so streaming latency is one token.

This runs on the event loop, never on the decode thread.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    __slots__ = ("_decoder", "_held", "_stops", "decoded", "stop_hit")

    def __init__(self, stops: Sequence[str] = ()) -> None:
        # Holds back a character split over tokens until it completes, and drops bytes that
        # never form UTF-8, so no U+FFFD the model did not write reaches a client.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._stops = tuple(stops)
        self._held = ""
        # The stop sequence that ended the text, once one has matched.
        self.stop_hit: str | None = None
        # Characters decoded so far, held back or not: what is emitted is always a
        # prefix of them (where a token's text starts, for its logprobs).
        self.decoded = 0

    def feed(self, piece: bytes) -> str:
        """Take one token's bytes; return the text that is now safe to emit."""
        text = self._decoder.decode(piece)
        self.decoded += len(text)
        return self._release(text, final=False)

    def finish(self) -> str:
        """End of generation: flush what was held back (it can no longer become a stop)."""
        return self._release(self._decoder.decode(b"", final=True), final=True)

    def _release(self, new_text: str, *, final: bool) -> str:
        if self.stop_hit is not None:
            return ""
        if not self._stops:
            return new_text
        text = self._held + new_text if self._held else new_text
        cut, hit = self._earliest_stop(text)
        if hit is not None:
            self.stop_hit = hit
            self._held = ""
            return text[:cut]
        keep = 0 if final else self._partial_stop_suffix(text)
        if keep:
            self._held = text[-keep:]
            return text[:-keep]
        self._held = ""
        return text

    def _earliest_stop(self, text: str) -> tuple[int, str | None]:
        best_at, best = len(text) + 1, None
        for stop in self._stops:
            at = text.find(stop)
            if at != -1 and at < best_at:
                best_at, best = at, stop
        return best_at, best

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop."""
        longest = 0
        for stop in self._stops:
            # Candidate starts: only where a tail longer than the best so far could begin.
            start = max(len(text) - len(stop) + 1, 0)
            limit = len(text) - longest
            at = text.find(stop[0], start, limit)
            while at != -1:
                if stop.startswith(text[at:]):
                    longest = len(text) - at
                    break
                at = text.find(stop[0], at + 1, limit)
        return longest
