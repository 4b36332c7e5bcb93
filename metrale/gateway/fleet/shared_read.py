"""One Redis read shared by every request that asks for it while it is in flight.

A burst of requests each checking the queue depth, or finding the liveness cache expired, would
otherwise send one identical read apiece. ``SharedRead`` runs the read once and hands its result
(or its exception) to every caller that asked while it was running: a caller's answer is at most
one read old (the read it joined was under way when it asked), never cached beyond that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Result = TypeVar("Result")


class SharedRead(Generic[Result]):
    """Calls ``read`` at most once at a time; concurrent callers await the same call."""

    def __init__(self, read: Callable[[], Awaitable[Result]]) -> None:
        self._read = read
        self._running: asyncio.Future[Result] | None = None

    async def __call__(self) -> Result:
        """The result of the read in flight, or of a new one if none is."""
        if self._running is None:
            self._running = asyncio.ensure_future(self._read())
            self._running.add_done_callback(self._forget)
        # A caller that is cancelled (its client left) must not cancel the read the others await.
        return await asyncio.shield(self._running)

    def _forget(self, done: asyncio.Future[Result]) -> None:
        if self._running is done:
            self._running = None
        if not done.cancelled():
            done.exception()  # retrieved here too, so a read nobody awaits any more logs no warning
