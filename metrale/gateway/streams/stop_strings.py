"""Stop strings, matched on the detokenized text of one choice as it streams.

Text that could be the start of a stop string is held back until the next piece of text shows whether
it is; everything else is released at once. When a stop string matches, the text is cut just before
it and the stop string itself is never shown (OpenAI's behaviour).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first occurrence of any of ``stops`` in a text that arrives in pieces.

    Invariant: the text released so far contains no stop string, and no stop string can begin inside
    it except within the held-back tail.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._held = ""
        self.matched = False

    def push(self, text: str) -> str:
        """Add ``text``; return what can be shown now. After a match, returns "" forever."""
        if self.matched:
            return ""
        self._held += text
        cut = self._first_match()
        if cut is not None:
            self.matched = True
            released, self._held = self._held[:cut], ""
            return released
        keep = self._partial_match_length()
        released = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return released

    def flush(self) -> str:
        """The held-back text, released because no more text will come."""
        released, self._held = self._held, ""
        return released

    def _first_match(self) -> int | None:
        positions = [index for stop in self._stops if (index := self._held.find(stop)) >= 0]
        return min(positions, default=None)

    def _partial_match_length(self) -> int:
        """The length of the longest tail of the held text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:length]):
                    longest = length
                    break
        return longest
