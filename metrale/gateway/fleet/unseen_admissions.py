"""Requests this gateway admitted that a read of the request streams may not show yet.

Between admitting a request and its ``XADD`` a gateway subscribes its channel (a round trip or
more), and a burst of requests checks the queue together (they share one read): without counting
its own admissions, a gateway would let a whole burst through on one stale read. A request counts
here from its admission until a stream read that *began* after its ``XADD`` (that read shows it);
one never submitted counts until it is withdrawn, or ``STALE_S`` at most.

Other gateways' admissions show once they are on a stream: between gateways the count is exact up
to the few milliseconds between a check and its ``XADD``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from metrale.shared.messages import Priority

STALE_S = 60.0
"""An admitted request neither submitted nor withdrawn by then is forgotten (a path that lost it)."""


@dataclass(slots=True)
class _Admitted:
    priority: Priority
    admitted_at: float
    submitted_at: float | None = None


class UnseenAdmissions:
    """Admitted requests by id; times are ``clock()`` (monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._admitted: dict[str, _Admitted] = {}

    def admit(self, request_id: str, priority: Priority) -> None:
        """``request_id`` was admitted now."""
        self._admitted[request_id] = _Admitted(Priority(priority), self._clock())

    def submitted(self, request_id: str) -> None:
        """``request_id``'s ``XADD`` completed now (a request not admitted here is ignored)."""
        admitted = self._admitted.get(request_id)
        if admitted is not None and admitted.submitted_at is None:
            admitted.submitted_at = self._clock()

    def withdraw(self, request_id: str) -> None:
        """``request_id`` will not be submitted after all (refused later, or failed first)."""
        admitted = self._admitted.get(request_id)
        if admitted is not None and admitted.submitted_at is None:
            del self._admitted[request_id]

    def unseen_by(self, read_began: float) -> Counter[Priority]:
        """Admitted requests, by priority, that a read begun at ``read_began`` does not show; forgets
        those it shows (every later read shows them too)."""
        now = self._clock()
        unseen: Counter[Priority] = Counter()
        for request_id, admitted in list(self._admitted.items()):
            shown = admitted.submitted_at is not None and admitted.submitted_at < read_began
            if shown or (admitted.submitted_at is None and now - admitted.admitted_at > STALE_S):
                del self._admitted[request_id]
            else:
                unseen[admitted.priority] += 1
        return unseen

    def __len__(self) -> int:
        return len(self._admitted)
