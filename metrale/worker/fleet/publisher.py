"""Writes a worker's batches from its loop, one write in flight while the next step runs.

The loop hands each step's ``Batch`` to ``submit``. Its token events and finishes leave as one write
that is only sent (``WorkerTransport.start_publish``); its replies are read when the next step's batch
comes, when Redis has long answered (or by ``drain``, which the loop calls before it waits idle). So
the engine steps while Redis works, as it would beside a publishing thread, but without one: a thread
woken every step competes for the GIL that torch releases and takes back around every operator, and
on two cores that cost the loop more than the writes themselves (``docs/BENCHMARKS.md``, session 11).
Invariants:

- Order: a batch leaves the queue only once wholly written, and the next one is started only after
  it; so every request's events reach the broker once each, in ``seq`` order, and its finish, dead
  letter or hand-back goes with or after its last events.
- Failure: a ``TransportError`` leaves the failed batch first in the queue (what it had written of it
  is not written again) and reaches the loop, which backs off as for any outage; its next call tries
  that batch again, then the ones queued behind it. Nothing is dropped or reordered.
- Barrier: ``drain`` returns once everything submitted is written.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from redis.backoff import ExponentialBackoff

from metrale.worker.fleet.outbox import Batch
from metrale.worker.fleet.transport import TransportError, WorkerTransport

logger = logging.getLogger(__name__)

DRAIN_BACKOFF = ExponentialBackoff(cap=1.0, base=0.05)
"""Pause between the tries of a ``drain`` given a timeout, by consecutive failures."""


class Publisher:
    """Sends submitted batches to ``transport``, in order, from the calling thread (the loop's)."""

    def __init__(self, transport: WorkerTransport) -> None:
        self._transport = transport
        self._queue: deque[Batch] = deque()  # not wholly written, oldest first
        self._in_flight: Callable[[], None] | None = None  # waits for the first batch's events
        self._handed_back = 0  # requests handed back since ``take_handed_back`` last read it

    @property
    def unsent(self) -> int:
        """Batches submitted and not yet wholly written."""
        return len(self._queue)

    def submit(self, batch: Batch) -> None:
        """Queue ``batch`` (if it holds anything) behind those before it, finish their writes and start
        its own, which stays in flight until a later ``submit`` brings a batch, or ``drain``. Raises the
        ``TransportError`` that stopped a write (``batch`` is queued all the same)."""
        if batch:
            self._queue.append(batch)
        self._advance(wait=False)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Write everything submitted. Without ``timeout_s`` a ``TransportError`` is raised as by
        ``submit``; with it, failed writes are tried again until then (False if still unwritten)."""
        if timeout_s is None:
            self._advance(wait=True)
            return True
        deadline = time.monotonic() + timeout_s
        failures = 0
        while True:
            try:
                self._advance(wait=True)
                return True
            except TransportError as exc:
                failures += 1
                delay = DRAIN_BACKOFF.compute(failures)
                if time.monotonic() + delay >= deadline:
                    logger.warning("%d batches still unwritten: %s", len(self._queue), exc)
                    return False
                time.sleep(delay)

    def take_handed_back(self) -> int:
        """How many requests were handed back since the last call."""
        count, self._handed_back = self._handed_back, 0
        return count

    def close(self, timeout_s: float) -> bool:
        """Write what is queued, trying for up to ``timeout_s``; True when nothing is left unsent."""
        try:
            return self.drain(timeout_s)
        except Exception:  # closing on the way out of a failure: that failure is the one reported
            logger.exception("could not write the last batches")
            return False

    def _advance(self, *, wait: bool) -> None:
        """Write the queued batches in order; unless ``wait``, the newest one's write is left in flight."""
        while self._queue:
            head = self._queue[0]
            if self._in_flight is None:
                self._in_flight = head.start(self._transport)
            if self._in_flight is not None:
                if not wait and len(self._queue) == 1:
                    return
                written, self._in_flight = self._in_flight, None
                written()
            self._handed_back += head.end(self._transport)
            self._queue.popleft()
