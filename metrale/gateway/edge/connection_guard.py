"""The open HTTP connections of one gateway server, and the cap on them.

A client that opens sockets and never finishes a request (slowloris) would otherwise hold them until
the process runs out of file descriptors, and then ``/health`` fails with everyone else. The guard
counts every connection (``guarded_protocol.py`` tells it when one opens, starts a request, goes idle
and closes). At ``max_connections``, a new connection closes the oldest one that is not in a request:
first those that never sent a whole request, then idle keep-alive ones; so a fresh ``/health`` still
gets through. When every connection is in a request, the new one is refused (closed). Evictions,
refusals and timeouts are logged as counts, at most one line per ``REPORT_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Protocol

REPORT_EVERY_S = 10.0

logger = logging.getLogger("metrale.gateway.connections")


class Connection(Protocol):
    """What the guard needs of a connection: a way to close it."""

    def evict(self) -> None:
        """Close the connection now."""
        ...


class ConnectionGuard:
    """At most ``max_connections`` open at once; which ones may be closed to make room."""

    def __init__(self, max_connections: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_connections = max_connections
        self._open: set[Connection] = set()
        # Not in a request, oldest first: never served a request, then idle after one.
        self._unserved: collections.OrderedDict[Connection, None] = collections.OrderedDict()
        self._idle: collections.OrderedDict[Connection, None] = collections.OrderedDict()
        self._log = ConnectionEvents(clock)

    @property
    def open_count(self) -> int:
        """Connections open now."""
        return len(self._open)

    def opened(self, connection: Connection) -> bool:
        """Count a new ``connection``; False when it must be refused (every open one is in a request)."""
        if len(self._open) >= self.max_connections:
            victim = self._oldest_waiting()
            if victim is None:
                self._log.note("refused (every connection in a request)")
                return False
            self.closed(victim)
            victim.evict()
            self._log.note("evicted (connection cap)")
        self._open.add(connection)
        self._unserved[connection] = None
        return True

    def in_request(self, connection: Connection) -> None:
        """``connection`` has sent a request's headers: it is not to be evicted until it is idle again."""
        self._unserved.pop(connection, None)
        self._idle.pop(connection, None)

    def idle(self, connection: Connection) -> None:
        """``connection`` has had its response and waits for the next request."""
        if connection in self._open:
            self._idle[connection] = None

    def closed(self, connection: Connection) -> None:
        """``connection`` is gone."""
        self._open.discard(connection)
        self._unserved.pop(connection, None)
        self._idle.pop(connection, None)

    def timed_out(self, phase: str) -> None:
        """A connection was closed because its ``phase`` (headers, body) took too long."""
        self._log.note(f"{phase} timeout")

    def _oldest_waiting(self) -> Connection | None:
        for waiting in (self._unserved, self._idle):
            if waiting:
                return next(iter(waiting))
        return None


class ConnectionEvents:
    """Counts of closed connections by reason, logged at most once per ``every_s``: the first at once,
    the rest as one line when the interval has passed."""

    def __init__(self, clock: Callable[[], float], every_s: float = REPORT_EVERY_S) -> None:
        self._clock = clock
        self._every_s = every_s
        self._counts: collections.Counter[str] = collections.Counter()
        self._logged_at = float("-inf")
        self._flush_scheduled = False

    def note(self, reason: str) -> None:
        """One connection closed for ``reason``."""
        self._counts[reason] += 1
        wait_s = self._logged_at + self._every_s - self._clock()
        if wait_s <= 0:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_later(wait_s, self.flush)

    def flush(self) -> None:
        """Log the counts since the last line, if any."""
        self._flush_scheduled = False
        if not self._counts:
            return
        since = "" if self._logged_at == float("-inf") else f" in {self._clock() - self._logged_at:.0f} s"
        parts = ", ".join(f"{count} {reason}" for reason, count in sorted(self._counts.items()))
        logger.warning("HTTP connections closed%s: %s", since, parts)
        self._counts.clear()
        self._logged_at = self._clock()
