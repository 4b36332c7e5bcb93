"""A worker's heartbeat: when it is due, what it says, and the counters pushed along with it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import redis

from metrale.shared.messages import WorkerHeartbeat, WorkerState
from metrale.worker.fleet.throughput import StepTimer, ThroughputMeter
from metrale.worker.fleet.transport import WorkerTransport
from metrale.worker.scheduler.scheduler import SchedulerStats

logger = logging.getLogger(__name__)

CounterPush = Callable[[], None]
"""Adds some counters to their shared hash; raises ``redis.RedisError`` when Redis is unreachable."""
WorkerCounters = Callable[[], Mapping[str, int]]
"""What a worker did since it started, by name, sent with each heartbeat."""
SlotAges = Callable[[], Sequence[float]]
"""How many seconds ago each request running on a worker was taken."""


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """What a worker is, for its heartbeat: where its model runs, how many state slots and KV
    blocks its engine has, and how long a step with every slot decoding took at start-up
    (``step_probe.py``; 0: not measured)."""

    device: str = ""
    total_slots: int = 0
    total_blocks: int = 0
    full_step_s: float = 0.0


EARLY_BEAT_FULL_STEPS = 4
"""After this many full steps in a row the heartbeat goes at once, with their period: a burst that
fills every slot is still being judged by the gateways, which then plan on its real pace."""


class Liveness:
    """Beats every third of ``ttl_s`` with the engine's load, the recent throughput and step time,
    the start-up probe's full step and the loop's recent period between full steps (every slot busy,
    one step right after another: what a slot's turn takes, publishing and waiting for the CPU
    included), the worker's state (taking or draining), its own counters and the ages of the
    requests it runs."""

    def __init__(
        self,
        worker_id: str,
        model: str,
        ttl_s: int,
        pushes: Sequence[CounterPush] = (),
        *,
        shape: WorkerShape = WorkerShape(),
        counters: WorkerCounters | None = None,
        slot_ages: SlotAges | None = None,
    ) -> None:
        self._worker_id = worker_id
        self._model = model
        self._every_s = ttl_s / 3
        self._pushes = pushes
        self._shape = shape
        self._counters = counters
        self._slot_ages = slot_ages
        self._meter = ThroughputMeter()
        self._steps = StepTimer()
        self._full_steps = StepTimer(window_s=30.0)
        self._last_full_at: float | None = None  # when the last step, if it was full, was noted
        self._full_run = 0  # full steps in a row
        self._last_batch_size = 0
        self._state = WorkerState.TAKING
        self._started_at = time.time()
        self._next_beat = 0.0

    def note_step(self, tokens: int, batch_size: int, seconds: float = 0.0) -> None:
        """One engine step of ``seconds`` produced ``tokens`` for ``batch_size`` outputs."""
        self._meter.add(tokens)
        self._steps.add(seconds)
        now = time.monotonic()
        full = bool(self._shape.total_slots) and batch_size >= self._shape.total_slots
        if full and self._last_full_at is not None:
            self._full_steps.add(now - self._last_full_at)
        self._last_full_at = now if full else None
        self._full_run = self._full_run + 1 if full else 0
        if self._full_run == EARLY_BEAT_FULL_STEPS:
            self.beat_now()  # a burst filled every slot: gateways learn its real pace now, not a beat later
        self._last_batch_size = batch_size

    def draining(self) -> None:
        """From now on the heartbeat says the worker drains; the next ``beat_if_due`` beats."""
        self._state = WorkerState.DRAINING
        self.beat_now()

    def beat_now(self) -> None:
        """Make the next ``beat_if_due`` beat, whenever it was due."""
        self._next_beat = 0.0

    def beat_if_due(self, transport: WorkerTransport, stats: SchedulerStats) -> None:
        """Send the heartbeat (``TransportError`` when unreachable) and push the counters, when due."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        transport.heartbeat(self.heartbeat(stats))
        self._next_beat = now + self._every_s
        self.push_counters()

    def heartbeat(self, stats: SchedulerStats) -> WorkerHeartbeat:
        """The heartbeat saying ``stats`` now."""
        counters = sorted(self._counters().items()) if self._counters is not None else []
        return WorkerHeartbeat(
            worker_id=self._worker_id,
            model=self._model,
            running=stats.running,
            waiting=stats.waiting,
            swapped=stats.swapped,
            batch_size=self._last_batch_size,
            tokens_per_s=self._meter.rate(),
            free_slots=stats.free_slots,
            free_blocks=stats.free_blocks,
            started_at=self._started_at,
            sent_at=time.time(),
            device=self._shape.device,
            state=self._state,
            step_time_s=self._steps.mean(),
            total_slots=self._shape.total_slots,
            total_blocks=self._shape.total_blocks,
            counters=counters,
            probe_step_s=self._shape.full_step_s,
            full_step_s=self._full_steps.mean(),
            slot_ages_ms=sorted(round(age * 1000) for age in self._slot_ages()) if self._slot_ages else [],
        )

    def push_counters(self) -> None:
        """Add every counter's growth to Redis; a failure only delays it to the next beat."""
        try:
            for push in self._pushes:
                push()
        except redis.RedisError as exc:
            logger.warning("counters not published: %s", exc)
