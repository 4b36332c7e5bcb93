"""The worker's I/O, behind one small interface: take requests and cancellations, publish events.

The engine loop (``metrale.worker.fleet.service.Worker``) talks only to a ``WorkerTransport``. Two
implementations: ``RedisTransport`` (``metrale.worker.fleet.broker.redis_transport``, the fleet protocol) and
``InMemoryTransport`` here (queues, for tests and offline runs).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from metrale.shared.codec import DecodeError, decode, encode
from metrale.shared.keys import check_segment
from metrale.shared.messages import (
    FinishReason,
    GenerateRequest,
    ModelAnnouncement,
    Priority,
    TokenEvent,
    WorkerControl,
    WorkerHeartbeat,
)
from metrale.shared.record import RunRecord, RunStatus


class TransportError(Exception):
    """The broker cannot be reached right now; the caller backs off and tries again."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A queue entry that could not be served, already moved aside (acknowledged and deleted)."""

    stream: str
    entry_id: str
    reason: str
    raw: bytes


@dataclass(frozen=True, slots=True)
class Redelivery:
    """A request some worker took before: one that died (its entry was reclaimed) or one that handed
    it back. ``record`` is its durable record as this worker took it (None if it has expired):
    the tokens already emitted, the seed, the next ``seq``. ``deliveries`` counts how often its queue
    entry has been handed to a worker, this time included."""

    request: GenerateRequest
    record: RunRecord | None
    deliveries: int

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True, slots=True)
class StartedRequest:
    """What a later worker needs to continue a request exactly: the seed it samples with, and the
    prompt tokens its first worker restored from a checkpoint (reported in its usage)."""

    request_id: str
    seed: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request all of whose choices have sent their final event; ``error`` only with ``ERROR`` or ``REFUSED``.

    ``dead_letter``, when set, is why the request's queue entry is also set aside in the dead-letter
    stream (a request that kept losing its worker).
    """

    request_id: str
    finish_reason: FinishReason
    error: str | None = None
    dead_letter: str | None = None


DUPLICATE_REASON = "a request with this id is already running on this worker"
"""Why a second entry for a request still in flight is set aside (the first one keeps running)."""

Received: TypeAlias = GenerateRequest | Redelivery | DeadLetter
"""What ``WorkerTransport.receive`` hands back per queue entry: a request taken for the first time,
one that ran before, or an entry already set aside."""


class WorkerTransport(Protocol):
    """Where a worker's requests come from and its token events go.

    Every method raises ``TransportError`` when the broker is unreachable; nothing is lost by that:
    the worker calls again with the same arguments once it is back.
    """

    def receive(self, max_new: int, block_ms: int, *, max_interactive: int | None = None) -> list[Received]:
        """Take at most ``max_new`` requests: those of lost workers first, then queued ones,
        interactive before batch. ``max_interactive`` (at least ``max_new``) lets more interactive ones
        in: those the scheduler makes room for by preempting batch sequences.

        Waits up to ``block_ms`` for the first one when none is queued (0: never waits). Entries that
        cannot be served (undecodable, wrong message kind, bad or duplicate request id) come back as
        ``DeadLetter`` s, already set aside.
        """
        ...

    def cancellations(self) -> list[str]:
        """The request ids cancelled since the last call (for any worker; unknown ids are ignored)."""
        ...

    def controls(self) -> list[WorkerControl]:
        """The orders an operator sent this worker since the last call (e.g. drain)."""
        ...

    def taken_over(self) -> list[str]:
        """Requests in flight here that other workers took over while this one's heartbeat had lapsed
        (it was starved, paused or cut off from the broker for longer than the TTL), since the last call.
        They continue there from their records; this worker drops them without another event."""
        ...

    def begin(self, started: Sequence[StartedRequest]) -> None:
        """Write each request's seed and cached tokens to its record (before any of its events)."""
        ...

    def publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> None:
        """Deliver ``events`` (in order) and close ``finished`` requests, all in one atomic write."""
        ...

    def start_publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> Callable[[], None]:
        """``publish``, started: returns once the write is on its way; the call returned waits until it
        is written (raising what ``publish`` would). Nothing else is published before that call."""
        ...

    def hand_back(self, request_ids: Sequence[str]) -> None:
        """Queue requests this worker took again at once, for any worker to resume from their records.

        Their events must already be published.
        """
        ...

    def heartbeat(self, stats: WorkerHeartbeat) -> None:
        """Say this worker is alive, with its load; expires unless repeated."""
        ...

    def announce(self, model: ModelAnnouncement) -> None:
        """Tell gateways what they need to serve ``model``."""
        ...

    def close(self) -> None:
        """Withdraw the heartbeat and release connections; the worker is gone."""
        ...


def parse_entry(raw: bytes | None) -> GenerateRequest | str:
    """Decode one queue entry's payload into a servable request, or say why it is not one."""
    if raw is None:
        return "the entry has no 'msg' field"
    message = decode(raw)
    if isinstance(message, DecodeError):
        return message.reason
    if not isinstance(message, GenerateRequest):
        return f"expected a {GenerateRequest.kind!r} message, got {message.kind!r}"
    try:
        check_segment(message.request_id, "request id")
        if message.reply_to is not None:
            check_segment(message.reply_to, "reply_to relay id")
    except ValueError as exc:
        return str(exc)
    return message


def ran_before(record: RunRecord | None) -> bool:
    """Whether a record shows a request that some worker already started (it has a seed or events)."""
    return record is not None and (record.seed is not None or bool(record.events))


def receive_limits(max_new: int, max_interactive: int | None) -> dict[Priority, int]:
    """How many requests a ``receive`` may hold in all once it has read each stream, in reading order:
    interactive ones up to ``max_interactive`` (never fewer than ``max_new``), then batch ones up to
    ``max_new``."""
    interactive = max(max_new, max_interactive if max_interactive is not None else max_new)
    return {Priority.INTERACTIVE: interactive, Priority.BATCH: max_new}


class InMemoryTransport:
    """A ``WorkerTransport`` over in-process queues; safe to feed from other threads.

    ``submit`` / ``submit_raw`` / ``cancel`` play the gateway's part, ``order`` an operator's; what the
    worker sent is kept in ``events``, ``finished``, ``publishes`` (one entry per ``publish`` call), ``started``,
    ``handed_back``, ``heartbeats``, ``announcements`` and ``dead_letters``. A request handed back is
    queued again and comes back as a ``Redelivery`` carrying the record built from what was sent.
    """

    def __init__(self) -> None:
        self._queues: dict[Priority, deque[tuple[str, bytes]]] = {p: deque() for p in Priority}
        self._cancelled: list[str] = []
        self._controls: list[WorkerControl] = []
        self._in_flight: dict[str, tuple[Priority, bytes]] = {}
        self._entry_ids = itertools.count(1)
        self._ready = threading.Condition()
        self.events: list[TokenEvent] = []
        self.finished: list[FinishedRequest] = []
        self.publishes: list[tuple[list[TokenEvent], list[FinishedRequest]]] = []
        self.started: dict[str, StartedRequest] = {}
        self.handed_back: list[str] = []
        self.heartbeats: list[WorkerHeartbeat] = []
        self.announcements: list[ModelAnnouncement] = []
        self.dead_letters: list[DeadLetter] = []
        self.closed = False

    def submit(self, request: GenerateRequest) -> None:
        """Queue ``request`` on its priority's queue."""
        self.submit_raw(encode(request), request.priority)

    def submit_raw(self, payload: bytes, priority: Priority = Priority.INTERACTIVE) -> None:
        """Queue an encoded payload as it would sit in a stream entry (it may be garbage)."""
        with self._ready:
            self._queues[priority].append((f"{next(self._entry_ids)}-0", payload))
            self._ready.notify_all()

    def cancel(self, request_id: str) -> None:
        """Broadcast a cancellation, as a gateway does."""
        with self._ready:
            self._cancelled.append(request_id)

    def order(self, control: WorkerControl) -> None:
        """Send the worker an operator's order, as ``met top`` does."""
        with self._ready:
            self._controls.append(control)

    def queued(self, priority: Priority) -> int:
        """How many entries still wait on ``priority``'s queue."""
        with self._ready:
            return len(self._queues[priority])

    def record(self, request_id: str) -> RunRecord | None:
        """The request's record as a Redis transport would hold it (seed, cached tokens, events)."""
        events = tuple(sorted((e for e in self.events if e.request_id == request_id), key=lambda e: e.seq))
        start = self.started.get(request_id)
        if start is None and not events:
            return None
        done = next((f for f in self.finished if f.request_id == request_id), None)
        status = RunStatus.FINISHED if done is not None else RunStatus.RUNNING
        reason, error = (done.finish_reason, done.error) if done is not None else (None, None)
        seed, cached = (start.seed, start.cached_tokens) if start is not None else (None, 0)
        return RunRecord(request_id, status, None, reason, error, events, seed, cached)

    def receive(self, max_new: int, block_ms: int, *, max_interactive: int | None = None) -> list[Received]:
        limits = receive_limits(max_new, max_interactive)
        with self._ready:
            if block_ms > 0 and max(limits.values()) > 0 and not any(self._queues.values()):
                self._ready.wait(block_ms / 1000)
            taken: list[Received] = []
            for priority in Priority:
                queue = self._queues[priority]
                while queue and len(taken) < limits[priority]:
                    taken.append(self._parse(priority, *queue.popleft()))
            return taken

    def cancellations(self) -> list[str]:
        with self._ready:
            cancelled, self._cancelled = self._cancelled, []
        return cancelled

    def controls(self) -> list[WorkerControl]:
        with self._ready:
            controls, self._controls = self._controls, []
        return controls

    def taken_over(self) -> list[str]:
        return []  # one worker, no heartbeat to lapse: nothing is ever taken from it

    def begin(self, started: Sequence[StartedRequest]) -> None:
        with self._ready:  # a test may call this from another thread while a loop is in ``receive``
            self.started.update((start.request_id, start) for start in started)

    def start_publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> Callable[[], None]:
        self.publish(events, finished)
        return _written

    def publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> None:
        with self._ready:
            self.publishes.append((list(events), list(finished)))
            self.events.extend(events)
            self.finished.extend(finished)
            for done in finished:
                self._in_flight.pop(done.request_id, None)

    def hand_back(self, request_ids: Sequence[str]) -> None:
        with self._ready:
            for request_id in request_ids:
                priority, payload = self._in_flight.pop(request_id)
                self._queues[priority].append((f"{next(self._entry_ids)}-0", payload))
                self.handed_back.append(request_id)
            self._ready.notify_all()

    def heartbeat(self, stats: WorkerHeartbeat) -> None:
        self.heartbeats.append(stats)

    def announce(self, model: ModelAnnouncement) -> None:
        self.announcements.append(model)

    def close(self) -> None:
        self.closed = True

    def _parse(self, priority: Priority, entry_id: str, payload: bytes) -> Received:
        parsed = parse_entry(payload)
        if isinstance(parsed, GenerateRequest) and parsed.request_id in self._in_flight:
            parsed = DUPLICATE_REASON
        if isinstance(parsed, str):
            dead = DeadLetter(priority.value, entry_id, parsed, payload)
            self.dead_letters.append(dead)
            return dead
        self._in_flight[parsed.request_id] = (priority, payload)
        record = self.record(parsed.request_id)
        return Redelivery(parsed, record, deliveries=1) if ran_before(record) else parsed


def _written() -> None:
    """The in-memory transport's writes are done when ``start_publish`` returns."""
