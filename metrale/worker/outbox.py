"""What a worker still has to write to the broker, kept until a write succeeds.

``flush`` sends in the order a later worker relies on: first the seeds of requests started here (a
record with events always names its seed), then token events and finished requests in one
``publish``, then hand-backs (a request is queued again only once its events are in its record).
A failed flush loses nothing: the same writes are tried again. A request's final events can be held
back (until its final checkpoint is stored) and released later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.shared.messages import TokenEvent
from metrale.worker.transport import FinishedRequest, StartedRequest, WorkerTransport


@dataclass(slots=True)
class _Held:
    """Final events of a request, kept back until its final checkpoint is stored."""

    events: list[TokenEvent] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


class Outbox:
    """Unsent writes of one worker, and the final events it holds back."""

    def __init__(self) -> None:
        self._starts: list[StartedRequest] = []
        self._events: list[TokenEvent] = []
        self._finished: list[FinishedRequest] = []
        self._handbacks: list[str] = []
        self._held: dict[str, _Held] = {}

    @property
    def holding(self) -> bool:
        """Whether some request's final events wait for its checkpoint."""
        return bool(self._held)

    @property
    def unsent_finished(self) -> int:
        return len(self._finished)

    def start(self, *started: StartedRequest) -> None:
        self._starts.extend(started)

    def hold(self, request_id: str) -> None:
        """Keep ``request_id``'s events and finish back from now on, until ``release``."""
        self._held[request_id] = _Held()

    def release(self, request_id: str) -> None:
        """Queue what was held back for ``request_id``, behind everything queued so far."""
        held = self._held.pop(request_id)
        self._events.extend(held.events)
        self._finished.extend(held.finished)

    def event(self, event: TokenEvent) -> None:
        held = self._held.get(event.request_id)
        (held.events if held is not None else self._events).append(event)

    def finish(self, done: FinishedRequest) -> None:
        held = self._held.get(done.request_id)
        (held.finished if held is not None else self._finished).append(done)

    def hand_back(self, request_id: str) -> None:
        self._handbacks.append(request_id)

    def flush(self, transport: WorkerTransport) -> int:
        """Send everything queued (raises ``TransportError``, keeping it); returns how many requests
        were handed back."""
        if self._starts:
            transport.begin(self._starts)
            self._starts = []
        if self._events or self._finished:
            transport.publish(self._events, self._finished)
            self._events, self._finished = [], []
        handed_back = len(self._handbacks)
        if self._handbacks:
            transport.hand_back(self._handbacks)
            self._handbacks = []
        return handed_back
