"""Requests that have reached the gateway and that admission control has not judged yet.

A burst arrives faster than the gateway parses it: its requests wait in the gateway, each ahead of
the next, before any of them is judged (``FleetAdmission.admit``) and counted in the backlog. Load
shedding (``load_shedding.py``) counts them as ahead of a new arrival, so that the burst's excess is
refused on arrival rather than once the gateway has worked through everything before it.

A request counts from ``arrived`` until admission control judges it (``judged``, called from the
request's own task: the ticket travels in a context variable) or, if it never gets that far (a bad
body, an unknown model), until its ``arrived`` block ends.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class _Ticket:
    __slots__ = ("arrived_at", "waiting")

    def __init__(self) -> None:
        self.waiting = True
        self.arrived_at = time.monotonic()


QUIET_PASSES = 3
"""Event-loop passes without a new arrival that settle the arrivals: a request already at the door is
read by the server in one pass (its protocol callback runs after the callbacks already ready), its
task takes its first step, and arrives, in the next, which the watcher sees in the one after."""


RELEASE_PER_PASS = 8
"""Callers of ``settled`` let go per event-loop pass once the arrivals settled. All at once, a
burst's refusals were made one after another in a single pass, which held the loop, and ``/health``
with it, for up to 0.75 s (200 streams against ``met serve`` on 2 vCPUs); in groups, the loop reads
its sockets between them."""

PACE_WINDOW_S = 60.0
"""How far back the gaps between judgements are averaged (``expected_delay_s``)."""

_current: ContextVar[_Ticket | None] = ContextVar("metrale_arrival", default=None)


class Arrivals:
    """A count of the requests between their arrival and their judgement, for one event loop."""

    def __init__(self) -> None:
        self.waiting = 0
        """Requests that have arrived and are not judged yet."""
        self.total = 0
        """Requests that have arrived, ever."""
        self._settling: asyncio.Future[None] | None = None
        self._released = 0  # callers of ``settled`` let go since the last settling began
        self._last_judged_at = 0.0  # time.monotonic() of the newest judgement
        self._busy_gaps: deque[tuple[float, float]] = deque()  # (when, seconds since the judgement before)
        self._busy_gaps_sum = 0.0  # of the seconds in ``_busy_gaps``
        self._watcher: asyncio.Future[None] | None = None

    async def settled(self) -> None:
        """Return once ``QUIET_PASSES`` passes of the event loop brought no new arrival: the requests of
        a burst already at the door arrive (and are judged on arrival) before the caller works on its
        own. One watcher serves every caller; they go on ``RELEASE_PER_PASS`` per event-loop pass, in
        the order they came."""
        if self._settling is None:
            self._settling = asyncio.get_running_loop().create_future()
            self._watcher = asyncio.ensure_future(self._watch(self._settling))
            self._released = 0
        await asyncio.shield(self._settling)
        order, self._released = self._released, self._released + 1
        for _ in range(order // RELEASE_PER_PASS):
            await asyncio.sleep(0)

    async def _watch(self, settling: asyncio.Future[None]) -> None:
        try:
            while True:
                seen = self.total
                for _ in range(QUIET_PASSES):
                    await asyncio.sleep(0)
                if self.total == seen:
                    break
        finally:
            self._settling = None
            if not settling.done():
                settling.set_result(None)

    @contextmanager
    def arrived(self) -> Iterator[None]:
        """The current task's request arrived: it counts until it is judged or the block ends."""
        ticket = _Ticket()
        token = _current.set(ticket)
        self.waiting += 1
        self.total += 1
        try:
            yield
        finally:
            self._settle(ticket)
            _current.reset(token)

    def judged(self) -> None:
        """The current task's request was judged (admitted or refused); nothing if it was not counted."""
        ticket = _current.get()
        if ticket is None or not ticket.waiting:
            return
        now = time.monotonic()
        if self.waiting > 1:  # busy: the gap since the judgement before (or its arrival) is its intake
            gap = now - max(self._last_judged_at, ticket.arrived_at)
            self._busy_gaps.append((now, gap))
            self._busy_gaps_sum += gap
        while self._busy_gaps and self._busy_gaps[0][0] < now - PACE_WINDOW_S:
            self._busy_gaps_sum -= self._busy_gaps.popleft()[1]
        if not self._busy_gaps:
            self._busy_gaps_sum = 0.0  # no rounding left over from the window's sums
        self._last_judged_at = now
        self._settle(ticket)

    def waited_s(self) -> float:
        """Seconds since the current task's request arrived (0 when it was not counted here)."""
        ticket = _current.get()
        return time.monotonic() - ticket.arrived_at if ticket is not None else 0.0

    def expected_delay_s(self) -> float:
        """How long a request arriving now will wait in this gateway before it is judged: the requests
        ahead of it, one busy intake each (the mean gap between judgements while others waited, over
        the last ``PACE_WINDOW_S``; 0 before any)."""
        if not self._busy_gaps:
            return 0.0
        return self.waiting * self._busy_gaps_sum / len(self._busy_gaps)

    def _settle(self, ticket: _Ticket) -> None:
        if ticket.waiting:
            ticket.waiting = False
            self.waiting -= 1
