"""What a worker still has to write to the broker, gathered into one batch per flush.

A ``Batch`` is sent in the order a later worker relies on: first the seeds of requests started here
(a record with events always names its seed), then token events and finished requests in one
``publish``, then hand-backs (a request is queued again only once its events are in its record).
Sending a batch that fails loses nothing: each part is dropped only once written, so the next try
sends the rest. A request's final events can be held back (until its final checkpoint is stored) and
released later, behind everything taken so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from metrale.shared.messages import TokenEvent
from metrale.worker.fleet.transport import FinishedRequest, StartedRequest, WorkerTransport


@dataclass(slots=True)
class _Held:
    """Final events of a request, kept back until its final checkpoint is stored."""

    events: list[TokenEvent] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


@dataclass(slots=True)
class Batch:
    """The writes of one flush, sent as ``begin``, ``publish``, ``hand_back``, in that order: ``start``
    writes the first and starts the second, ``end`` writes the third once the second is written."""

    starts: list[StartedRequest] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    handbacks: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.starts or self.events or self.finished or self.handbacks)

    def start(self, transport: WorkerTransport) -> Callable[[], None] | None:
        """Write the seeds, then start writing the events and finishes (``start_publish``); the call
        returned waits for that write (None: nothing to wait for). ``end`` writes the rest after it.

        Raises ``TransportError`` keeping the parts not yet written (a part written is emptied once it
        is), so starting again resumes where it stopped, never writing a part twice.
        """
        if self.starts:
            transport.begin(self.starts)
            self.starts = []
        if not (self.events or self.finished):
            return None
        wait = transport.start_publish(self.events, self.finished)

        def written() -> None:
            wait()
            self.events, self.finished = [], []

        return written

    def end(self, transport: WorkerTransport) -> int:
        """Write the hand-backs (once the events are written); returns how many requests it handed back."""
        handed_back = len(self.handbacks)
        if self.handbacks:
            transport.hand_back(self.handbacks)
            self.handbacks = []
        return handed_back


class Outbox:
    """Unsent writes of one worker, and the final events it holds back. Used by the loop's thread only."""

    def __init__(self) -> None:
        self._pending = Batch()
        self._held: dict[str, _Held] = {}

    @property
    def holding(self) -> bool:
        """Whether some request's final events wait for its checkpoint."""
        return bool(self._held)

    def start(self, *started: StartedRequest) -> None:
        self._pending.starts.extend(started)

    def hold(self, request_id: str) -> None:
        """Keep ``request_id``'s events and finish back from now on, until ``release``."""
        self._held[request_id] = _Held()

    def release(self, request_id: str) -> None:
        """Queue what was held back for ``request_id``, behind everything queued so far."""
        held = self._held.pop(request_id)
        self._pending.events.extend(held.events)
        self._pending.finished.extend(held.finished)

    def event(self, event: TokenEvent) -> None:
        held = self._held.get(event.request_id)
        (held.events if held is not None else self._pending.events).append(event)

    def finish(self, done: FinishedRequest) -> None:
        held = self._held.get(done.request_id)
        (held.finished if held is not None else self._pending.finished).append(done)

    def hand_back(self, request_id: str) -> None:
        self._pending.handbacks.append(request_id)

    def take(self) -> Batch:
        """Everything queued since the last ``take`` (held-back events stay), as one batch to send."""
        batch, self._pending = self._pending, Batch()
        return batch
