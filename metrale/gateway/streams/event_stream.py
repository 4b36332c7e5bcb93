"""One request's token events, put back in ``seq`` order for its reader.

Events reach a gateway from two sources that may overlap or arrive late: the request's pub/sub channel
and its durable record (read to fill a gap). ``EventStream`` accepts both and hands its reader each
``seq`` exactly once, in order: an event below the next expected ``seq`` is a duplicate and dropped;
one above it waits until the events before it arrive. A reader left waiting ``idle_fill_s`` asks
for a fill (a read of the record) and goes on waiting: a lost message is recovered even when no later
one arrives to reveal the gap.

The record also tells when waiting is pointless. The record is written in ``seq`` order, in the
same transaction as each ``PUBLISH``, so a record that holds later events but not the next one
lost it for good, and a record gone for ``lost_after_s`` while no event arrives was lost with its
queue entry (a Redis restarted without persistence): no worker will ever send what is missing,
and the reader gets ``NoWorker`` instead of waiting for its deadline.
"""

from __future__ import annotations

import asyncio
import time
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
    ) -> None:
        self.request_id = request_id
        self._fill = fill
        self._idle_fill_s = idle_fill_s
        self._lost_after_s = lost_after_s
        self.next_seq = 0
        self._held: dict[int, TokenEvent] = {}
        self._ready: asyncio.Queue[TokenEvent] = asyncio.Queue()
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
        while self.next_seq in self._held:
            self._ready.put_nowait(self._held.pop(self.next_seq))
            self.next_seq += 1
        self._missing_since = None

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

    async def next(self) -> TokenEvent:
        """The next event in ``seq`` order; waits until it arrives. Raises ``NoWorker`` once the
        record shows the request lost."""
        if not self._ready.empty():  # no idle timer to set and cancel for an event already here
            return self._ready.get_nowait()
        while True:
            if self._lost is not None and self._ready.empty():
                raise NoWorker(self._lost)
            try:
                async with asyncio.timeout(self._idle_fill_s if self._fill is not None else None):
                    return await self._ready.get()
            except TimeoutError:
                assert self._fill is not None
                await self._fill()
