"""The worker's one loop: take cancellations and requests, step the engine, publish what it produced.

Each iteration: abort what was cancelled; take as many new requests as the engine can start soon;
run one engine step; publish that step's events, and the requests it finished, in one
``publish``; send the heartbeat when due. With checkpoints, a request resumes from the longest
checkpointed prefix of its prompt, its snapshots are saved by a background writer, and its final
events are held back until its final checkpoint is stored. When ``stop`` is set (the CLI sets it on SIGTERM) the
worker takes nothing new, finishes what it runs for up to ``drain_timeout_s``, aborts the rest,
withdraws its heartbeat and returns. A ``TransportError`` never ends the loop: unsent events stay
queued here and the iteration is retried after a capped backoff.
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import redis
from redis.backoff import ExponentialBackoff

from metrale.shared.messages import FinishReason, GenerateRequest, ModelAnnouncement, TokenEvent, WorkerHeartbeat
from metrale.shared.settings import WorkerSettings
from metrale.worker.admission import engine_request, refusal
from metrale.worker.checkpoint_writer import CheckpointWriter, SaveJob
from metrale.worker.checkpoints.counters_sink import RedisCounterSink
from metrale.worker.engine import Engine
from metrale.worker.request import RequestOutput, ResumePoint
from metrale.worker.snapshots import Snapshot
from metrale.worker.throughput import ThroughputMeter
from metrale.worker.tracker import RequestTracker
from metrale.worker.transport import DeadLetter, FinishedRequest, Received, TransportError, WorkerTransport

logger = logging.getLogger(__name__)

IDLE_BLOCK_MS = 50
"""How long an idle worker waits for a request in one ``receive``."""
RECONNECT_BACKOFF = ExponentialBackoff(cap=5.0, base=0.1)
"""Pause before retrying an iteration that hit a ``TransportError``, by consecutive failures."""
REMEMBERED_CANCELS = 4096
"""Cancellations of requests not (yet) seen here that are kept, in case the request arrives later."""
SHUTDOWN_MESSAGE = "worker shutting down"


@dataclass(slots=True)
class _Held:
    """Final events of a request, kept back until its final checkpoint is stored."""

    events: list[TokenEvent] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


def default_worker_id() -> str:
    """``{host}-{pid}-{random}``, restricted to the characters a Redis key segment allows."""
    host = re.sub(r"[^A-Za-z0-9._\-]", "-", socket.gethostname())[:64] or "worker"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    """Serves ``engine`` from ``transport`` as worker ``worker_id``, announcing ``model``.

    ``seed`` seeds the seeds drawn for requests that bring none. Runs in the calling thread; meant to
    be its process's main loop or a thread of ``met serve``.
    """

    def __init__(
        self,
        engine: Engine,
        transport: WorkerTransport,
        settings: WorkerSettings,
        *,
        worker_id: str,
        model: ModelAnnouncement,
        seed: int | None = None,
        checkpoints: CheckpointWriter | None = None,
        counter_sink: RedisCounterSink | None = None,
    ) -> None:
        self._engine = engine
        self._transport = transport
        self._settings = settings
        self._worker_id = worker_id
        self._model = model
        self._seeds = random.Random(seed)
        self._trackers: dict[str, RequestTracker] = {}
        self._unsent_events: list[TokenEvent] = []
        self._unsent_finished: list[FinishedRequest] = []
        self._early_cancels: OrderedDict[str, None] = OrderedDict()
        self._meter = ThroughputMeter()
        self._last_batch_size = 0
        self._started_at = time.time()
        self._announced = False
        self._next_heartbeat = 0.0
        self._drain_deadline: float | None = None
        self._checkpoints = checkpoints
        self._counter_sink = counter_sink
        self._held: dict[str, _Held] = {}

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set and the drain is over; always withdraws the heartbeat.

        An unexpected error (a bug, a Redis command refused) fails every request in flight, then
        propagates.
        """
        stop = stop or threading.Event()
        logger.info("worker %s serving %s", self._worker_id, self._model.model)
        try:
            while not self._iterate(stop):
                pass
        except TransportError as exc:
            logger.error("worker %s exits: Redis still unreachable after the drain timeout (%s)", self._worker_id, exc)
        except Exception:
            logger.exception("worker %s exits: unexpected error", self._worker_id)
            self._fail_in_flight("internal error: the worker failed")
            raise
        else:
            logger.info("worker %s exits: stop requested and the drain is complete", self._worker_id)
        finally:
            self._close()

    def _iterate(self, stop: threading.Event) -> bool:
        """One pass of the loop, retried on transport errors; True once stopped and drained."""
        failures = 0
        while True:
            try:
                return self._serve_once(stop)
            except TransportError as exc:
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    raise
                failures += 1
                delay = RECONNECT_BACKOFF.compute(failures)
                logger.warning("transport unavailable (%s); retrying in %.2f s", exc, delay)
                self._announced = False  # Redis may have restarted empty
                time.sleep(delay)

    def _serve_once(self, stop: threading.Event) -> bool:
        self._check_stop(stop)  # first: a stop must start the drain clock even while Redis is down
        if not self._announced:
            self._transport.announce(self._model)
            self._announced = True
            self._next_heartbeat = 0.0
        self._flush()  # what a failed iteration could not send
        self._apply_cancellations()
        if self._drain_deadline is None:
            idle = not self._engine.has_unfinished()
            self._admit(self._transport.receive(self._capacity(), IDLE_BLOCK_MS if idle else 0))
        if self._engine.has_unfinished():
            outputs = self._engine.step()
            self._record(outputs, self._save_snapshots(self._engine.take_snapshots()))
        self._release_held()
        self._flush()
        self._heartbeat_if_due()
        return self._drain_deadline is not None and not self._trackers and not self._held

    def _check_stop(self, stop: threading.Event) -> None:
        """Start the drain when ``stop`` is first seen; abort what is left once it has timed out."""
        now = time.monotonic()
        if stop.is_set() and self._drain_deadline is None:
            self._drain_deadline = now + self._settings.drain_timeout_s
            logger.info(
                "stop requested: finishing %d requests for up to %.1f s, taking no new ones",
                len(self._trackers),
                self._settings.drain_timeout_s,
            )
        if self._drain_deadline is not None and now >= self._drain_deadline and self._trackers:
            logger.warning("drain timeout: aborting %d unfinished requests", len(self._trackers))
            for request_id in list(self._trackers):
                self._engine.abort(request_id)
                self._finish_early(request_id, FinishReason.ABORT)

    def _capacity(self) -> int:
        """New requests the engine can start soon: free slots not already spoken for by waiting ones."""
        stats = self._engine.stats()
        return max(0, stats.free_slots - stats.waiting)

    def _apply_cancellations(self) -> None:
        for request_id in self._transport.cancellations():
            if request_id in self._trackers:
                self._engine.abort(request_id)
                self._finish_early(request_id, FinishReason.ABORT)
                logger.info("cancelled %s", request_id)
            else:  # not here (yet): it may still be queued, or run on another worker
                self._early_cancels[request_id] = None
                if len(self._early_cancels) > REMEMBERED_CANCELS:
                    self._early_cancels.popitem(last=False)

    def _admit(self, received: Sequence[Received]) -> None:
        for item in received:
            if isinstance(item, DeadLetter):
                logger.warning("set aside entry %s of %s: %s", item.entry_id, item.stream, item.reason)
            else:
                self._start(item)

    def _start(self, message: GenerateRequest) -> None:
        request_id = message.request_id
        self._trackers[request_id] = RequestTracker(message, self._worker_id)
        if request_id in self._early_cancels:
            del self._early_cancels[request_id]
            self._finish_early(request_id, FinishReason.ABORT)
            return
        reason = refusal(message, self._model)
        if reason is None:
            try:
                resume = self._lookup(message)
                snapshots = self._checkpoints is not None
                self._engine.add_request(engine_request(message, self._seeds, resume=resume, snapshots=snapshots))
                self._trackers[request_id].cached_tokens = resume.length if resume is not None else 0
                return
            except ValueError as exc:  # PromptTooLongError, or sampling settings out of range
                reason = str(exc)
        logger.info("refused %s: %s", request_id, reason)
        self._finish_early(request_id, FinishReason.ERROR, reason)

    def _lookup(self, message: GenerateRequest) -> ResumePoint | None:
        """The longest valid checkpointed prefix of the prompt, if checkpoints are on and one exists."""
        if self._checkpoints is None:
            return None
        lookup = self._checkpoints.manager.find(
            message.tenant,
            message.prompt_token_ids,
            session_id=message.session_id,
            marks=message.checkpoint_positions,
        )
        if lookup.resume is None:
            return None
        return ResumePoint(lookup.resume.length, lookup.resume.state)

    def _save_snapshots(self, snapshots: Sequence[Snapshot]) -> set[str]:
        """Hand snapshots to the writer; return the requests whose final events wait for theirs."""
        if self._checkpoints is None or not snapshots:
            return set()
        by_request: dict[str, list[Snapshot]] = {}
        for snapshot in snapshots:
            by_request.setdefault(snapshot.request_id, []).append(snapshot)
        waiting = set()
        for request_id, taken in by_request.items():
            message = self._trackers[request_id].message
            final = any(s.final for s in taken)
            self._checkpoints.submit(SaveJob(message.tenant, message.session_id, taken, request_id if final else None))
            if final:
                waiting.add(request_id)
                self._held[request_id] = _Held()
        return waiting

    def _release_held(self) -> None:
        """Send the held-back events of requests whose final checkpoint is now stored."""
        if self._checkpoints is None:
            return
        for request_id in self._checkpoints.released():
            held = self._held.pop(request_id)
            self._unsent_events.extend(held.events)
            self._unsent_finished.extend(held.finished)

    def _record(self, outputs: list[RequestOutput], hold: AbstractSet[str] = frozenset()) -> None:
        """Queue the events of one step's outputs (held back for requests in ``hold``); retire the
        requests it finished."""
        touched: dict[str, RequestTracker] = {}
        for output in outputs:
            tracker = self._trackers[output.request_id]
            event = tracker.on_output(output)
            if event is not None:
                target = self._held[output.request_id].events if output.request_id in hold else self._unsent_events
                target.append(event)
            touched[output.request_id] = tracker
        for request_id, tracker in touched.items():
            if tracker.done:
                target_finished = self._held[request_id].finished if request_id in hold else self._unsent_finished
                target_finished.append(tracker.outcome())
                del self._trackers[request_id]
        self._meter.add(sum(len(output.token_ids) for output in outputs))
        self._last_batch_size = len(outputs)

    def _finish_early(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        """End a request before the engine did: final events for its open choices, then retire it."""
        tracker = self._trackers.pop(request_id)
        self._unsent_events.extend(tracker.finish_all(reason, error))
        self._unsent_finished.append(tracker.outcome())

    def _flush(self) -> None:
        if self._unsent_events or self._unsent_finished:
            self._transport.publish(self._unsent_events, self._unsent_finished)
            self._unsent_events, self._unsent_finished = [], []

    def _heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        stats = self._engine.stats()
        heartbeat = WorkerHeartbeat(
            worker_id=self._worker_id,
            model=self._model.model,
            running=stats.running,
            waiting=stats.waiting,
            swapped=stats.swapped,
            batch_size=self._last_batch_size,
            tokens_per_s=self._meter.rate(),
            free_slots=stats.free_slots,
            free_blocks=stats.free_blocks,
            started_at=self._started_at,
            sent_at=time.time(),
        )
        self._transport.heartbeat(heartbeat)
        self._next_heartbeat = now + self._settings.heartbeat_ttl_s / 3
        self._push_counters()

    def _push_counters(self) -> None:
        if self._counter_sink is not None and self._checkpoints is not None:
            try:
                self._counter_sink.push(self._checkpoints.manager.counters)
            except redis.RedisError as exc:
                logger.warning("checkpoint counters not published: %s", exc)

    def _fail_in_flight(self, error: str) -> None:
        for request_id in list(self._trackers):
            self._finish_early(request_id, FinishReason.ERROR, error)
        try:
            self._flush()
        except TransportError as exc:
            logger.error("could not tell clients of %d failed requests: %s", len(self._unsent_finished), exc)

    def _close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()
            self._push_counters()
            logger.info(self._checkpoints.manager.counters.summary())
        try:
            self._transport.close()
        except TransportError as exc:
            logger.warning("could not withdraw the heartbeat of worker %s: %s", self._worker_id, exc)
