"""Writes a worker's batches on a background thread, so its loop steps the engine while Redis answers.

The loop hands each step's ``Batch`` to ``submit`` and goes on with the next step; one thread sends
the batches one at a time, in the order submitted (like vLLM's asynchronous output processing, the
step after this one runs while this one's events are published). Invariants:

- Order: a batch leaves the queue only once wholly written, and the next one is sent only after it;
  so every request's events reach the broker once each, in ``seq`` order, and its finish, dead letter
  or hand-back goes with or after its last events.
- Failure: a ``TransportError`` parks the thread with the failed batch still first in the queue (what
  it had written of it is not written again). The loop's next ``submit`` or ``drain`` raises that
  error, the loop backs off as for any outage, and its next call after that lets the thread try
  again: retries keep the loop's reconnect pace, and nothing is dropped or reordered.
- Backpressure: ``submit`` returns only once at most ``max_queued`` batches are unsent (the one being
  written included), so the loop runs at most that far ahead of the broker. While sending is parked
  by a failure nothing waits: batches queue up behind the failed one.
- Barrier: ``drain`` returns once everything submitted is written.

Any other exception from the transport (a bug, a command Redis refused) stops the thread for good;
every later call raises ``PublisherFailed`` from it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from metrale.worker.fleet.outbox import Batch
from metrale.worker.fleet.transport import TransportError, WorkerTransport

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED = 2
"""Unsent batches the loop may leave behind it: the one being written and the next step's."""


class PublisherFailed(RuntimeError):
    """The publishing thread died of an error that retrying cannot cure."""


class BackgroundPublisher:
    """Sends submitted batches to ``transport`` on one daemon thread, started by the first ``submit``.

    ``submit``, ``drain``, ``take_handed_back`` and ``close`` are meant for one thread (the loop's);
    the transport's ``begin``, ``publish`` and ``hand_back`` run on the publishing thread, meanwhile the
    loop may call the transport's other methods.
    """

    def __init__(self, transport: WorkerTransport, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self._transport = transport
        self._max_queued = max_queued
        self._changed = threading.Condition()  # guards every field below; notified on each change
        self._queue: deque[Batch] = deque()  # unsent, oldest first; the first one may be being written
        self._failure: TransportError | None = None  # set: the thread is parked, the first batch unsent
        self._failure_reported = False  # the loop has been told of ``_failure``; its next call retries
        self._broken: BaseException | None = None  # set: the thread is gone for good
        self._closing = False
        self._handed_back = 0  # requests handed back since ``take_handed_back`` last read it
        self._thread: threading.Thread | None = None

    @property
    def unsent(self) -> int:
        """Batches submitted and not yet wholly written."""
        with self._changed:
            return len(self._queue)

    def submit(self, batch: Batch) -> None:
        """Queue ``batch`` (if it holds anything) behind those submitted before it.

        Waits while more than ``max_queued`` batches are unsent. Raises the ``TransportError`` that
        parked the thread once (``batch`` is queued all the same); the next call resumes sending.
        """
        with self._changed:
            self._raise_if_broken()
            if batch:
                self._queue.append(batch)
                self._start_thread()
                self._changed.notify_all()
            self._resume_or_raise()
            self._changed.wait_for(lambda: len(self._queue) <= self._max_queued or self._stopped)
            self._raise_new_failure()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until everything submitted is written (True), or ``timeout_s`` passed (False).

        Raises the ``TransportError`` that stops the writing, as ``submit`` does.
        """
        with self._changed:
            self._raise_if_broken()
            self._resume_or_raise()
            drained = self._changed.wait_for(lambda: not self._queue or self._stopped, timeout_s)
            self._raise_new_failure()
            return drained and not self._queue

    def take_handed_back(self) -> int:
        """How many requests were handed back since the last call."""
        with self._changed:
            count, self._handed_back = self._handed_back, 0
            return count

    def close(self, timeout_s: float) -> bool:
        """Write what is queued unless sending has failed, stop the thread (waiting up to ``timeout_s``);
        True when nothing is left unsent."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._changed:
            return not self._queue

    @property
    def _stopped(self) -> bool:
        """Whether the thread sends nothing until the loop calls again (or ever)."""
        return self._failure is not None or self._broken is not None

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
            self._thread.start()

    def _resume_or_raise(self) -> None:
        """Raise a failure the loop has not seen yet; resume sending after one it has seen."""
        self._raise_new_failure()
        if self._failure is not None:
            self._failure = None
            self._changed.notify_all()

    def _raise_new_failure(self) -> None:
        self._raise_if_broken()
        if self._failure is not None and not self._failure_reported:
            self._failure_reported = True
            raise self._failure

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise PublisherFailed(f"the publishing thread failed: {self._broken!r}") from self._broken

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closing or (bool(self._queue) and not self._stopped))
                if not self._queue or self._stopped:  # closing, with nothing it may write
                    return
                batch = self._queue[0]
            try:
                handed_back = batch.send(self._transport)
            except TransportError as exc:
                with self._changed:
                    self._failure, self._failure_reported = exc, False
                    self._changed.notify_all()
                continue
            except BaseException as exc:
                logger.exception("the publishing thread failed")
                with self._changed:
                    self._broken = exc
                    self._changed.notify_all()
                return
            with self._changed:
                self._queue.popleft()
                self._handed_back += handed_back
                self._changed.notify_all()
