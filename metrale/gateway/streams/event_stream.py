"""One request's token events, put back in ``seq`` order for its reader.

Events reach a gateway from two sources that may overlap or arrive late: pub/sub (its relay's reply
channel, where a step's events come grouped, or the request's own channel) and its durable record (read
to fill a gap). ``EventStream`` accepts both and hands its reader each
``seq`` exactly once, in order: an event below the next expected ``seq`` is a duplicate and dropped;
one above it waits until the events before it arrive. A reader left waiting ``idle_fill_s`` asks
for a fill (a read of the record) and goes on waiting: a lost message is recovered even when no later
one arrives to reveal the gap.

The record also tells when waiting is pointless. The record is written in ``seq`` order, in the
same transaction as each ``PUBLISH``, so a record that holds later events but not the next one
lost it for good, and a record gone for ``lost_after_s`` while no event arrives was lost with its
queue entry (a Redis restarted without persistence): no worker will ever send what is missing,
and the reader gets ``NoWorker`` instead of waiting for its deadline.

A stream's reader waits once per event it reads, so the wake-up timer of a wait (the idle fill or the
deadline) is per token. With ``one_timer`` (the default) a stream keeps one timer and moves it only
when it fires early: a wait whose wake time is at or after the armed timer's keeps it, and a timer that
fires before the current wait's wake time is armed again (never more than ``idle_fill_s`` ahead); so a
stream that hears an event every few milliseconds arms one timer per ``idle_fill_s``, not one per
event. ``one_timer=False`` arms and cancels a timer per wait, the reference path; both wake a reader at
the same times.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence

from metrale.shared.errors import NoWorker
from metrale.shared.messages import TokenEvent

LOST_RECORD = "the request was lost: its record vanished from Redis (restarted without persistence?); retry it"
LOST_EVENTS = "the request was lost: events it sent vanished from Redis (restarted without persistence?); retry it"


class EventStream:
    """The in-order events of one request.

    Invariant: ``next_seq`` is the ``seq`` of the next event the reader gets; every event held back
    has a larger ``seq``.
    """

    def __init__(
        self,
        request_id: str,
        fill: Callable[[], Awaitable[None]] | None = None,
        idle_fill_s: float = 5.0,
        lost_after_s: float = 15.0,
        *,
        one_timer: bool = True,
    ) -> None:
        self.request_id = request_id
        self._one_timer = one_timer
        self._fill = fill
        self._idle_fill_s = idle_fill_s
        self._lost_after_s = lost_after_s
        self.next_seq = 0
        self._held: dict[int, TokenEvent] = {}
        self._ready: deque[TokenEvent] = deque()
        self._waiter: asyncio.Future[bool] | None = None  # set while the reader waits in ``next``
        self._wake_at = math.inf  # loop time at which the waiting reader is woken if no event comes
        self._timer: asyncio.TimerHandle | None = None  # with ``one_timer``: armed, not yet fired
        self._missing_since: float | None = None
        self._lost: str | None = None

    @property
    def has_gap(self) -> bool:
        """Whether a later event arrived before an earlier one (a message was lost on the way)."""
        return bool(self._held)

    def offer(self, events: Iterable[TokenEvent]) -> None:
        """Take ``events`` (any order, duplicates allowed) and release every one that is now in order."""
        for event in events:
            if event.request_id == self.request_id and event.seq >= self.next_seq:
                self._held.setdefault(event.seq, event)
        released = self.next_seq
        while self.next_seq in self._held:
            self._ready.append(self._held.pop(self.next_seq))
            self.next_seq += 1
        self._missing_since = None
        if self.next_seq > released:
            self._wake()

    def note_record(self, events: Sequence[TokenEvent] | None) -> None:
        """Take a read of the request's record: its events, or None when it does not exist."""
        if events is None:
            now = time.monotonic()
            self._missing_since = self._missing_since or now
            if now - self._missing_since >= self._lost_after_s:
                self._lost = LOST_RECORD
            return
        self.offer(events)
        if any(event.seq > self.next_seq for event in events):
            self._lost = LOST_EVENTS  # the record holds later events, and not the next one
            self._wake()

    def take_ready(self) -> TokenEvent | None:
        """The next event if it has arrived already, else None (``next`` without a coroutine)."""
        return self._ready.popleft() if self._ready else None

    async def next(self, deadline: float = math.inf) -> TokenEvent:
        """The next event in ``seq`` order; waits until it arrives. Raises ``NoWorker`` once the
        record shows the request lost, ``TimeoutError`` at ``deadline`` (event loop time).

        One wait is one future and a wake-up at the earlier of the idle fill and the deadline (a timer
        of its own, or the stream's one timer), set only when no event is ready."""
        while not self._ready:
            if self._lost is not None:
                raise NoWorker(self._lost)
            loop = asyncio.get_running_loop()
            now = loop.time()
            if now >= deadline:
                raise TimeoutError
            fill_at = now + self._idle_fill_s if self._fill is not None else math.inf
            wake_at = min(fill_at, deadline)
            waiter: asyncio.Future[bool] = loop.create_future()  # True: woken by the timer
            self._waiter, self._wake_at = waiter, wake_at
            timer = None
            if self._one_timer:
                self._arm(loop)
            elif wake_at < math.inf:
                timer = loop.call_at(wake_at, _set_done, waiter, True)
            try:
                timed_out = await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if timed_out and fill_at <= deadline and not self._ready and self._lost is None:
                assert self._fill is not None
                await self._fill()
        return self._ready.popleft()

    def close(self) -> None:
        """Let go of the stream once its reader is done: cancel its timer (an armed timer would hold the
        stream, and every event it kept, until it fires) and drop the events not read."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._held.clear()
        self._ready.clear()

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make the stream's timer fire at or before ``_wake_at``, and within ``idle_fill_s``: the armed
        one if it does. (Within ``idle_fill_s``, so that the timer of a stream no longer read, which
        holds the stream until it fires, fires soon even when the last wake time was a far deadline.)"""
        if self._wake_at == math.inf:
            return
        when = min(self._wake_at, loop.time() + self._idle_fill_s)
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = loop.call_at(when, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the waiting reader if its wake time has come; else arm the timer for it. A timer that
        finds no reader is not armed again (the next wait arms one)."""
        self._timer = None
        if self._waiter is None:
            return
        if loop.time() < self._wake_at:
            self._arm(loop)
        else:
            _set_done(self._waiter, True)

    def _wake(self) -> None:
        if self._waiter is not None:
            _set_done(self._waiter, False)


def _set_done(waiter: asyncio.Future[bool], timed_out: bool) -> None:
    if not waiter.done():
        waiter.set_result(timed_out)
