"""How many tokens this gateway's recent requests asked for, for a fleet that has not finished any yet.

Until a worker reports finished requests, the tokens a request takes to leave its slot are unknown;
a burst's requests are planned as asking, on average, what the last ``window`` requests with a limit
asked (``n × max_tokens``). A request without a limit (a chat's ``max_tokens`` left out) says nothing
and is not counted.
"""

from __future__ import annotations

from collections import deque


class RequestedTokens:
    """The mean ``n × max_tokens`` of the last ``window`` requests that set a limit."""

    def __init__(self, window: int = 256) -> None:
        self._recent: deque[int] = deque(maxlen=window)
        self._total = 0

    def note(self, tokens: int | None) -> None:
        """One more request, asking for up to ``tokens`` (None: no limit given)."""
        if tokens is None or tokens <= 0:
            return
        if len(self._recent) == self._recent.maxlen:
            self._total -= self._recent[0]
        self._recent.append(tokens)
        self._total += tokens

    def mean(self) -> float | None:
        """The mean of the requests noted (None before any)."""
        return self._total / len(self._recent) if self._recent else None
