"""A worker's heartbeat: when it is due, what it says, and the counters pushed along with it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import redis

from metrale.shared.messages import WorkerHeartbeat
from metrale.worker.fleet.throughput import ThroughputMeter
from metrale.worker.fleet.transport import WorkerTransport
from metrale.worker.scheduler.scheduler import SchedulerStats

logger = logging.getLogger(__name__)

CounterPush = Callable[[], None]
"""Adds some counters to their shared hash; raises ``redis.RedisError`` when Redis is unreachable."""


class Liveness:
    """Beats every third of ``ttl_s`` with the engine's load and the recent throughput."""

    def __init__(self, worker_id: str, model: str, ttl_s: int, pushes: Sequence[CounterPush] = ()) -> None:
        self._worker_id = worker_id
        self._model = model
        self._every_s = ttl_s / 3
        self._pushes = pushes
        self._meter = ThroughputMeter()
        self._last_batch_size = 0
        self._started_at = time.time()
        self._next_beat = 0.0

    def note_step(self, tokens: int, batch_size: int) -> None:
        """One engine step produced ``tokens`` for ``batch_size`` outputs."""
        self._meter.add(tokens)
        self._last_batch_size = batch_size

    def beat_now(self) -> None:
        """Make the next ``beat_if_due`` beat, whenever it was due."""
        self._next_beat = 0.0

    def beat_if_due(self, transport: WorkerTransport, stats: SchedulerStats) -> None:
        """Send the heartbeat (``TransportError`` when unreachable) and push the counters, when due."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        transport.heartbeat(
            WorkerHeartbeat(
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
            )
        )
        self._next_beat = now + self._every_s
        self.push_counters()

    def push_counters(self) -> None:
        """Add every counter's growth to Redis; a failure only delays it to the next beat."""
        try:
            for push in self._pushes:
                push()
        except redis.RedisError as exc:
            logger.warning("counters not published: %s", exc)
