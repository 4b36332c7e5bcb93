"""One request's token events, put back in ``seq`` order for its reader.

Events reach a gateway from two sources that may overlap or arrive late: the request's pub/sub channel
and its durable record (read to fill a gap). ``EventStream`` accepts both and hands its reader each
``seq`` exactly once, in order: an event below the next expected ``seq`` is a duplicate and dropped;
one above it waits until the events before it arrive. A reader left waiting ``idle_fill_s`` asks
for a fill (a read of the record) and goes on waiting: a lost message is recovered even when no later
one arrives to reveal the gap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from metrale.shared.messages import TokenEvent


class EventStream:
    """The in-order events of one request.

    Invariant: ``next_seq`` is the ``seq`` of the next event the reader gets; every event held back
    has a larger ``seq``.
    """

    def __init__(
        self, request_id: str, fill: Callable[[], Awaitable[None]] | None = None, idle_fill_s: float = 5.0
    ) -> None:
        self.request_id = request_id
        self._fill = fill
        self._idle_fill_s = idle_fill_s
        self.next_seq = 0
        self._held: dict[int, TokenEvent] = {}
        self._ready: asyncio.Queue[TokenEvent] = asyncio.Queue()

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

    async def next(self) -> TokenEvent:
        """The next event in ``seq`` order; waits until it arrives."""
        while True:
            try:
                async with asyncio.timeout(self._idle_fill_s if self._fill is not None else None):
                    return await self._ready.get()
            except TimeoutError:
                assert self._fill is not None
                await self._fill()
