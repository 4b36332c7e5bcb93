"""The retries this gateway has asked for: refused requests told to come back at a given time.

A burst's refusals all see about the same queue. A ``Retry-After`` computed from that queue alone sends
them all back in the same second, where the fleet has room for only a few of them again: each request
retries once a second until its turn, many times over (a thundering herd). So each refusal counts the
requests refused before it and told to come back, not yet due, as ahead of it (``FleetAdmission``):
the k-th is sent back when the fleet should have drained k more, and the retries return at the pace
the fleet takes them. A promise lapses at its time: by then its request has come back and been judged
again (counted in the backlog if it was admitted), or it went away.
"""

from __future__ import annotations

import heapq
import time


class RetryPromises:
    """The times (``time.monotonic()``) refused requests were told to come back, until they pass."""

    def __init__(self) -> None:
        self._due: list[float] = []  # a heap: the earliest first

    def outstanding(self, now: float | None = None) -> int:
        """The promises not yet due at ``now`` (default: the current time)."""
        now = time.monotonic() if now is None else now
        while self._due and self._due[0] <= now:
            heapq.heappop(self._due)
        return len(self._due)

    def promise(self, retry_after_s: float, now: float | None = None) -> None:
        """A request was refused and told to come back in ``retry_after_s`` seconds."""
        now = time.monotonic() if now is None else now
        heapq.heappush(self._due, now + retry_after_s)
