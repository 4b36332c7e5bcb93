"""Reads of the request streams that never overlap this gateway's own submissions.

Admission control counts a request this gateway admitted either in a read of the streams (once its
``XADD`` is there) or in ``UnseenAdmissions`` (until then), never in both. A read that ran while one
of its ``XADD`` s was in flight would not say which: the entry may or may not be in the read, and the
gateway would count it twice or not at all. So a read waits for the writes in flight to finish and
holds new ones back until it has its answer; a write is marked submitted (``UnseenAdmissions``)
before it lets a read go. Every read is then exact for this gateway's own requests. Writes run
beside each other; there is one read at a time (``SharedRead``), and it is one round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class ReadsBetweenWrites:
    """Writes run together; a read runs alone. For the tasks of one event loop."""

    def __init__(self) -> None:
        self._writing = 0
        self._reading = False
        self._writes_done = asyncio.Event()
        self._writes_done.set()
        self._read_done = asyncio.Event()
        self._read_done.set()

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """A write: it starts once no read is waiting or running."""
        while self._reading:
            await self._read_done.wait()
        self._writing += 1
        self._writes_done.clear()
        try:
            yield
        finally:
            self._writing -= 1
            if self._writing == 0:
                self._writes_done.set()

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """A read: from now on new writes wait; it starts once the writes in flight are done."""
        self._reading = True
        self._read_done.clear()
        try:
            while self._writing:
                await self._writes_done.wait()
            yield
        finally:
            self._reading = False
            self._read_done.set()
