"""The worker's one loop: take cancellations and requests, step the engine, publish what it produced.

Each iteration: abort what was cancelled; take as many requests as the engine can start soon;
run one engine step; hand that step's events, and the requests it finished, to the publisher
(``publisher.py``), which sends them in one write whose replies it reads after the next step; send
the heartbeat when due. With checkpoints, a request resumes from the longest checkpointed prefix of
its prompt, its snapshots (prompt and decode checkpoints) are saved by a background writer, and its
final events are held back until its final checkpoint is stored.

A request that ran before on a lost worker (or one that handed it back) continues from its durable
record: the same seed, the next ``seq``, its emitted tokens prefilled from the newest checkpoint of
them, nothing sent twice. One given to more than ``max_deliveries`` workers ends with an error and
a dead-letter entry. When ``stop`` is set (the CLI sets it on SIGTERM), or an operator orders a drain
on the worker's control channel (``met top``'s ``d``, obeyed exactly like SIGTERM), the worker takes
nothing new and its heartbeat says it drains;
with ``drain_handoff`` it checkpoints its requests and hands them back to the queue at once; what
it keeps gets up to ``drain_timeout_s`` to finish, then is aborted; it withdraws its heartbeat and
returns, once everything it produced is written. A ``TransportError`` (raised by the transport, or by
the publisher for a batch it could not write) never ends the loop: unsent events stay queued, in order,
and the iteration is retried after a capped backoff (a Redis that restarted empty gets the records of
what runs here written again by the transport).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence

from redis.backoff import ExponentialBackoff

from metrale.shared.messages import ControlAction, FinishReason, ModelAnnouncement
from metrale.shared.settings import WorkerSettings
from metrale.worker.checkpoints.counters_sink import RedisCounterSink
from metrale.worker.checkpoints.writer import CheckpointWriter, SaveJob
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import RequestOutput
from metrale.worker.engine.snapshots import Snapshot
from metrale.worker.fleet.admission import keeps_final_state
from metrale.worker.fleet.failover_counters import FailoverCounters, HashCounterSink
from metrale.worker.fleet.intake import Intake, Refused, tracker_for
from metrale.worker.fleet.liveness import Liveness, WorkerShape
from metrale.worker.fleet.outbox import Outbox
from metrale.worker.fleet.publisher import Publisher
from metrale.worker.fleet.speculation_counters import heartbeat_fields, speculation_fields
from metrale.worker.fleet.throughput import SlotTimes
from metrale.worker.fleet.tracker import RequestTracker
from metrale.worker.fleet.transport import (
    DeadLetter,
    FinishedRequest,
    Received,
    TransportError,
    WorkerTransport,
)

logger = logging.getLogger(__name__)

IDLE_BLOCK_MS = 50
"""How long an idle worker waits for a request in one ``receive``."""
WRITER_WAIT_MS = 5
"""How long a worker with nothing to step but final events held back waits for the checkpoint writer
before looking for new requests again."""
RECONNECT_BACKOFF = ExponentialBackoff(cap=5.0, base=0.1)
"""Pause before retrying an iteration that hit a ``TransportError``, by consecutive failures."""
REMEMBERED_CANCELS = 4096
"""Cancellations of requests not (yet) seen here that are kept, in case the request arrives later."""
SHUTDOWN_MESSAGE = "worker shutting down"
PUBLISHER_CLOSE_TIMEOUT_S = 10.0
"""How long a worker that failed or lost Redis waits, while exiting, for its unsent batches."""


def default_worker_id() -> str:
    """``{host}-{pid}-{random}``, restricted to the characters a Redis key segment allows."""
    host = re.sub(r"[^A-Za-z0-9._\-]", "-", socket.gethostname())[:64] or "worker"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    """Serves ``engine`` from ``transport`` as worker ``worker_id``, announcing ``model``.

    A request that brings no seed samples with ``seed_for`` its id. Runs in the calling thread; meant to
    be its process's main loop or a thread of ``met serve``. ``failover_sink`` receives the failover
    counters with every heartbeat, ``speculation_sink`` the speculative decoding ones. ``device`` is
    where the engine runs, as the heartbeat says it, and ``full_step_s`` how long a step with every
    slot decoding took at start-up (``step_probe.py``).
    """

    def __init__(
        self,
        engine: Engine,
        transport: WorkerTransport,
        settings: WorkerSettings,
        *,
        worker_id: str,
        model: ModelAnnouncement,
        checkpoints: CheckpointWriter | None = None,
        counter_sink: RedisCounterSink | None = None,
        failover_sink: HashCounterSink | None = None,
        speculation_sink: HashCounterSink | None = None,
        device: str = "",
        full_step_s: float = 0.0,
    ) -> None:
        self._engine = engine
        self._transport = transport
        self._settings = settings
        self._worker_id = worker_id
        self._model = model
        self._trackers: dict[str, RequestTracker] = {}
        self._steps = 0  # engine steps taken (counted with a stream interval only)
        self._outbox = Outbox()
        self._publisher = Publisher(transport)
        self._early_cancels: OrderedDict[str, None] = OrderedDict()
        self._announced = False
        self._drain_deadline: float | None = None
        self._checkpoints = checkpoints
        self._handing_back: set[str] = set()  # suspended; their checkpoint is being stored
        self.failover = FailoverCounters()
        self._slot_times = SlotTimes()
        self._intake = Intake(engine, model, settings, checkpoints, self.failover)
        pushes = []
        if counter_sink is not None and checkpoints is not None:
            pushes.append(lambda: counter_sink.push(checkpoints.manager.counters))
        if failover_sink is not None:
            pushes.append(lambda: failover_sink.push(self.failover.fields()))
        if speculation_sink is not None:
            pushes.append(lambda: speculation_sink.push(speculation_fields(engine.speculation_stats())))
        config = engine.config
        shape = WorkerShape(device, config.num_slots, config.num_blocks, full_step_s)
        self._liveness = Liveness(
            worker_id,
            model.model,
            settings.heartbeat_ttl_s,
            pushes,
            shape=shape,
            counters=self._own_counters,
            slot_ages=self._slot_ages,
        )

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
            self._liveness.beat_now()  # before taking anything: others must see this worker alive
            self._liveness.beat_if_due(self._transport, self._engine.stats())
            self._announced = True
        self._flush()  # after a failure this loop backed off from: the publisher tries its batches again
        self._apply_cancellations()
        self._drop_taken_over()
        self._obey_controls(stop)
        if self._drain_deadline is None:
            idle = not self._engine.has_unfinished() and not self._awaiting_writer
            if idle:
                self._publisher.drain()  # nothing steps meanwhile: the write in flight is finished first
            batch, interactive = self._capacity()
            self._admit(self._transport.receive(batch, IDLE_BLOCK_MS if idle else 0, max_interactive=interactive))
        if self._engine.has_unfinished():
            began = time.perf_counter()
            outputs = self._engine.step()
            stepped_s = time.perf_counter() - began
            snapshotted = self._save_snapshots(self._engine.take_snapshots())
            self._record(outputs, stepped_s, snapshotted)
        elif self._awaiting_writer and self._checkpoints is not None:
            # Nothing to step: the next thing to send is what the writer releases (final events whose
            # checkpoint is being stored); waiting on Redis instead would delay it by a whole block.
            self._checkpoints.wait_released(WRITER_WAIT_MS / 1000)
        self._release_held()
        self._flush()
        self._liveness.beat_if_due(self._transport, self._engine.stats())
        drained = self._drain_deadline is not None and not self._trackers and not self._awaiting_writer
        if drained:
            self._publisher.drain()  # barrier: done only once all it produced is written
        return drained

    @property
    def _awaiting_writer(self) -> bool:
        """Whether final events or hand-backs wait for the checkpoint writer to store a checkpoint."""
        return self._outbox.holding or bool(self._handing_back)

    def _check_stop(self, stop: threading.Event) -> None:
        """Start the drain when ``stop`` is first seen; abort what is left once it has timed out."""
        now = time.monotonic()
        if stop.is_set() and self._drain_deadline is None:
            self._drain_deadline = now + self._settings.drain_timeout_s
            self._liveness.draining()
            if self._settings.drain_handoff:
                self._hand_back_all()
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

    def _obey_controls(self, stop: threading.Event) -> None:
        """An operator's drain order is a SIGTERM: set ``stop`` and start the drain now."""
        for control in self._transport.controls():
            if control.action is ControlAction.DRAIN and not stop.is_set():
                logger.info("worker %s ordered to drain: %s", self._worker_id, control.reason)
                stop.set()
                self._check_stop(stop)

    def _slot_ages(self) -> list[float]:
        """How long ago each request in flight here was taken, in seconds."""
        now = time.monotonic()
        return [max(0.0, now - tracker.taken_at) for tracker in self._trackers.values()]

    def _own_counters(self) -> dict[str, int]:
        """What this worker did since it started, for its heartbeat."""
        stats = self._engine.stats()
        counters = {"swap_outs": stats.swap_outs, "restarts": stats.restarts, **self.failover.fields()}
        counters |= self._slot_times.fields()
        counters |= heartbeat_fields(self._engine.speculation_stats())
        if self._checkpoints is not None:
            done = self._checkpoints.manager.counters
            counters |= {"checkpoint_lookups": done.lookups, "checkpoint_hits": done.hits}
            counters["checkpoint_tokens_reused"] = done.tokens_reused
        return counters

    def _capacity(self) -> tuple[int, int]:
        """New requests the engine can start soon, of any priority and interactive ones: free slots not
        already spoken for by waiting ones; an interactive request may also take a batch sequence's
        slot (the scheduler preempts it)."""
        stats = self._engine.stats()
        free = max(0, stats.free_slots - stats.waiting)
        return free, max(free, stats.free_slots + stats.running_batch - stats.waiting_interactive)

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

    def _drop_taken_over(self) -> None:
        """Stop what other workers took over while this one's heartbeat had lapsed: they continue it
        from its record, so this worker publishes nothing more of it (their seqs are theirs now)."""
        for request_id in self._transport.taken_over():
            if request_id in self._trackers:
                self._engine.abort(request_id)
                del self._trackers[request_id]
                self.failover.taken_over_requests += 1
                logger.warning("dropped %s: another worker took it over", request_id)

    def _admit(self, received: Sequence[Received]) -> None:
        for item in received:
            if isinstance(item, DeadLetter):
                logger.warning("set aside entry %s of %s: %s", item.entry_id, item.stream, item.reason)
                continue
            tracker = tracker_for(item, self._worker_id, stream_interval=self._settings.stream_interval)
            request_id = tracker.request_id
            self._trackers[request_id] = tracker
            if request_id in self._early_cancels:
                del self._early_cancels[request_id]
                self._finish_early(request_id, FinishReason.ABORT)
                continue
            outcome = self._intake.start(item, tracker)
            if isinstance(outcome, Refused):
                logger.info("refused %s: %s", request_id, outcome.reason)
                dead_letter = outcome.reason if outcome.dead_letter else None
                self._finish_early(request_id, outcome.finish_reason, outcome.reason, dead_letter=dead_letter)
            else:
                self._outbox.start(outcome)

    def _hand_back_all(self) -> None:
        """Suspend every request another worker can continue exactly; queue each again once the
        checkpoint of its state is stored."""
        for request_id, tracker in list(self._trackers.items()):
            if not tracker.resumable:
                continue
            self._send_unsent(tracker)  # the record holds every token the suspended state consumed
            snapshot = self._engine.suspend(request_id)
            del self._trackers[request_id]
            if snapshot is not None and self._checkpoints is not None:
                message = tracker.message
                self._checkpoints.submit(SaveJob(message.tenant, None, [snapshot], release=request_id))
                self._handing_back.add(request_id)
            else:
                self._outbox.hand_back(request_id)
        logger.info("handing back the requests that can continue elsewhere; keeping %d", len(self._trackers))

    def _save_snapshots(self, snapshots: Sequence[Snapshot]) -> set[str]:
        """Hand snapshots to the writer; hold back the final events of requests until theirs is stored.
        The requests snapshotted."""
        if self._checkpoints is None or not snapshots:
            return set()
        by_request: dict[str, list[Snapshot]] = {}
        for snapshot in snapshots:
            by_request.setdefault(snapshot.request_id, []).append(snapshot)
        for request_id, taken in by_request.items():
            message = self._trackers[request_id].message
            final = any(s.final for s in taken)
            self._checkpoints.submit(SaveJob(message.tenant, message.session_id, taken, request_id if final else None))
            if final:
                self._outbox.hold(request_id)
        return set(by_request)

    def _release_held(self) -> None:
        """Send the held-back events, and hand back the suspended requests, whose checkpoint is stored."""
        if self._checkpoints is None:
            return
        for request_id in self._checkpoints.released():
            if request_id in self._handing_back:
                self._handing_back.remove(request_id)
                self._outbox.hand_back(request_id)
            else:
                self._outbox.release(request_id)

    def _record(self, outputs: list[RequestOutput], stepped_s: float, snapshotted: set[str]) -> None:
        """Queue the events of one step's outputs; retire the requests it finished."""
        touched: dict[str, RequestTracker] = {}
        for output in outputs:
            tracker = self._trackers[output.request_id]
            event = tracker.on_output(output)
            if event is not None:
                self._outbox.event(event)
            touched[output.request_id] = tracker
        if self._settings.stream_interval > 1:
            self._send_held(touched, snapshotted)
        for request_id, tracker in touched.items():
            if tracker.done:
                self._outbox.finish(tracker.outcome())
                del self._trackers[request_id]
                self._slot_times.add(time.monotonic() - tracker.taken_at, sum(tracker.completion_tokens))
                if self._checkpoints is not None and not keeps_final_state(tracker.message):
                    self._checkpoints.forget(tracker.message.tenant, request_id)  # its decode checkpoint
        self._liveness.note_step(sum(len(output.token_ids) for output in outputs), len(outputs), stepped_s)

    def _send_held(self, touched: dict[str, RequestTracker], snapshotted: set[str]) -> None:
        """With a stream interval, send the tokens requests hold back: every request's in each step whose
        number is a multiple of the interval (so that at one token a step all streams' events of a window
        leave in one write, one round trip to Redis, not one write per step); otherwise those of a request
        whose state was just snapshotted (a checkpoint is found only by a worker whose record holds every
        token it consumed) or that did not step (waiting behind others, it could hold them for long)."""
        self._steps += 1
        every_stream = self._steps % self._settings.stream_interval == 0
        for request_id, tracker in self._trackers.items():
            if tracker.unsent and (every_stream or request_id not in touched or request_id in snapshotted):
                self._send_unsent(tracker)

    def _send_unsent(self, tracker: RequestTracker) -> None:
        for event in tracker.take_unsent():
            self._outbox.event(event)

    def _finish_early(
        self, request_id: str, reason: FinishReason, error: str | None = None, *, dead_letter: str | None = None
    ) -> None:
        """End a request before the engine did: final events for its open choices, then retire it."""
        tracker = self._trackers.pop(request_id)
        for event in tracker.finish_all(reason, error):
            self._outbox.event(event)
        outcome = tracker.outcome()
        self._outbox.finish(FinishedRequest(request_id, outcome.finish_reason, outcome.error, dead_letter))
        if self._checkpoints is not None:
            self._checkpoints.forget(tracker.message.tenant, request_id)

    def _flush(self) -> None:
        """Hand what the outbox gathered to the publisher, behind every batch before it; raises the
        ``TransportError`` that stopped the write (the batch stays queued there)."""
        try:
            self._publisher.submit(self._outbox.take())
        finally:
            self.failover.handed_back_requests += self._publisher.take_handed_back()

    def _fail_in_flight(self, error: str) -> None:
        failed = len(self._trackers)
        for request_id in list(self._trackers):
            self._finish_early(request_id, FinishReason.ERROR, error)
        try:
            self._flush()
            if not self._publisher.drain(PUBLISHER_CLOSE_TIMEOUT_S):
                logger.error("could not tell clients of %d failed requests in time", failed)
        except Exception as exc:  # already failing: the error that got us here is the one to raise
            logger.error("could not tell clients of %d failed requests: %s", failed, exc)

    def _close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()
            logger.info(self._checkpoints.manager.counters.summary())
        if not self._publisher.close(PUBLISHER_CLOSE_TIMEOUT_S):
            logger.error("worker %s exits with %d batches of events unsent", self._worker_id, self._publisher.unsent)
        self.failover.handed_back_requests += self._publisher.take_handed_back()
        self._liveness.push_counters()
        try:
            self._transport.close()
        except TransportError as exc:
            logger.warning("could not withdraw the heartbeat of worker %s: %s", self._worker_id, exc)
