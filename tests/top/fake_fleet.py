"""A fake fleet for ``met top``: writes to a real Redis (one, or a Redis Cluster) what gateways, workers
and batch runners write, with the real codec, keys and record functions, at times given by a pinned
clock; like them, each transaction over the keys of one hash slot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from metrale.gateway.batches.batch_store import active_member
from metrale.gateway.batches.objects import Batch, BatchStatus, RequestCounts
from metrale.gateway.fleet.dispatcher import STREAM_FIELD
from metrale.shared.codec import encode
from metrale.shared.heartbeats import queue_heartbeat, queue_withdrawal
from metrale.shared.keys import QUEUE_FULL_FIELD, WORKER_GROUP, Keys
from metrale.shared.messages import GenerateRequest, Priority, TokenEvent, WorkerHeartbeat, WorkerState
from metrale.shared.record import (
    RunStatus,
    append_encoded,
    record_released,
    record_start,
    record_taken,
    refresh_record,
    set_status,
)
from metrale.shared.redis_connect import SyncClient

HEARTBEAT_TTL_S = 600
"""Long, so that a test's heartbeats do not expire while it runs."""


def heartbeat(worker_id: str, now: float, **fields: Any) -> WorkerHeartbeat:
    """A busy worker's heartbeat sent ``age_s`` (default 1) before ``now``."""
    age_s = fields.pop("age_s", 1.0)
    values: dict[str, Any] = {
        "model": "kimi-tiny",
        "running": 3,
        "waiting": 1,
        "swapped": 0,
        "batch_size": 3,
        "tokens_per_s": 42.5,
        "free_slots": 5,
        "free_blocks": 200,
        "device": "cpu",
        "state": WorkerState.TAKING,
        "step_time_s": 0.071,
        "total_slots": 8,
        "total_blocks": 256,
        "counters": [("handed_back_requests", 0), ("resumed_requests", 2), ("swap_outs", 1)],
    }
    values |= fields
    return WorkerHeartbeat(worker_id=worker_id, started_at=now - 3600, sent_at=now - age_s, **values)


@dataclass
class FakeFleet:
    """Writes one fleet's state under ``keys`` at the moment ``now``."""

    client: SyncClient
    keys: Keys
    now: float
    _entry_ms: dict[str, int] = field(default_factory=dict, init=False)  # by stream

    def worker(self, worker_id: str, **fields: Any) -> WorkerHeartbeat:
        """A live worker beats (fields of ``heartbeat``)."""
        beat = heartbeat(worker_id, self.now, **fields)
        with self.client.pipeline(transaction=True) as pipe:
            queue_heartbeat(pipe, beat, ttl_s=HEARTBEAT_TTL_S, keys=self.keys)
            pipe.execute()
        return beat

    def lost_worker(self, worker_id: str, *, age_s: float = 40.0) -> None:
        """A worker that beat ``age_s`` ago and died: its index entry outlived its heartbeat key."""
        self.worker(worker_id, age_s=age_s)
        self.client.delete(self.keys.worker(worker_id))

    def stopped_worker(self, worker_id: str) -> None:
        """A worker that withdrew its heartbeat, as a clean exit does."""
        with self.client.pipeline(transaction=True) as pipe:
            queue_withdrawal(pipe, worker_id, keys=self.keys)
            pipe.execute()

    def submit(self, request: GenerateRequest) -> None:
        """A gateway queues ``request``: its record ``QUEUED`` and an entry in its shard's stream dated its
        creation (or just after the stream's last entry)."""
        self._ensure_groups()
        stream = self._stream_of(request)
        entry_ms = max(int(request.created_at * 1000), self._entry_ms.get(stream, 0) + 1)
        self._entry_ms[stream] = entry_ms
        with self.client.pipeline(transaction=True) as pipe:
            set_status(pipe, request.request_id, RunStatus.QUEUED, keys=self.keys)
            pipe.xadd(stream, {STREAM_FIELD: encode(request)}, id=f"{entry_ms}-0")
            pipe.execute()

    def take(self, worker_id: str, requests: Sequence[GenerateRequest], *, tokens: int, taken_ago_s: float) -> None:
        """``worker_id`` takes ``requests`` (just submitted, none queued before them) as its transport
        does, and has emitted ``tokens`` tokens of each, one event per token."""
        by_stream: dict[str, int] = {}
        for request in requests:
            self.submit(request)
            by_stream[self._stream_of(request)] = by_stream.get(self._stream_of(request), 0) + 1
        for stream, count in by_stream.items():
            self.client.xreadgroup(WORKER_GROUP, worker_id, {stream: ">"}, count=count)
        for request in requests:  # a request's record and its shard's running index: one slot
            with self.client.pipeline(transaction=True) as pipe:
                taken_at = self.now - taken_ago_s
                record_taken(pipe, request, worker_id=worker_id, taken_at=taken_at, keys=self.keys)
                record_start(pipe, request.request_id, seed=7, cached_tokens=0, keys=self.keys)
                pipe.execute()
        for request in requests:
            self.emit(request.request_id, worker_id, tokens)

    def emit(self, request_id: str, worker_id: str, tokens: int, *, first_seq: int = 0) -> None:
        """``tokens`` more events of one token each, appended to the record as a worker's publish does."""
        events = [encode(TokenEvent(request_id, 0, first_seq + i, [11], worker_id)) for i in range(tokens)]
        with self.client.pipeline(transaction=True) as pipe:
            if events:
                append_encoded(pipe, request_id, events, keys=self.keys)
            refresh_record(pipe, request_id, worker_id=worker_id, keys=self.keys)
            pipe.execute()

    def finish(self, request_id: str) -> None:
        """The request's worker finishes it (status, and out of the running index)."""
        from metrale.shared.messages import FinishReason

        with self.client.pipeline(transaction=True) as pipe:
            set_status(pipe, request_id, RunStatus.FINISHED, finish_reason=FinishReason.STOP, keys=self.keys)
            record_released(pipe, request_id, keys=self.keys)
            pipe.execute()

    def counters(self, *, checkpoints: dict[str, int], failover: dict[str, int]) -> None:
        """Workers add their counters (``HINCRBY``, as their sinks do)."""
        with self.client.pipeline(transaction=True) as pipe:
            for name, n in checkpoints.items():
                pipe.hincrby(self.keys.checkpoint_counters(), name, n)
            for name, n in failover.items():
                pipe.hincrby(self.keys.failover_counters(), name, n)
            pipe.execute()

    def dead_letter(self, reason: str) -> None:
        shard = self.keys.shards - 1  # any shard's: met top sums them
        stream = self.keys.request_stream(Priority.INTERACTIVE, shard)
        fields: dict[Any, Any] = {"reason": reason, "stream": stream, "entry_id": "1-0", "raw": b"\x00"}
        self.client.xadd(self.keys.dead_letter(shard), fields)

    def rejected(self, count: int) -> None:
        """Gateways answered ``count`` requests with a 429."""
        self.client.hincrby(self.keys.gateway_counters(), QUEUE_FULL_FIELD, count)

    def batch(self, tenant: str, batch_id: str, *, total: int, completed: int, failed: int, running_s: float) -> None:
        """An in-progress batch, as the batch store writes it, started ``running_s`` ago."""
        created = int(self.now - running_s - 5)
        batch = Batch(
            id=batch_id,
            endpoint="/v1/chat/completions",
            input_file_id="file-in",
            completion_window="24h",
            status=BatchStatus.IN_PROGRESS,
            created_at=created,
            in_progress_at=int(self.now - running_s),
            request_counts=RequestCounts(total=total, completed=completed, failed=failed),
        )
        self.client.hset(self.keys.batch(tenant, batch_id), mapping=batch.to_fields())  # type: ignore[arg-type]
        self.client.zadd(self.keys.active_batches(), {active_member(tenant, batch_id): created})

    def _stream_of(self, request: GenerateRequest) -> str:
        return self.keys.request_stream(request.priority, self.keys.shard_of(request.request_id))

    def _ensure_groups(self) -> None:
        for priority in Priority:
            for stream in self.keys.request_streams(priority):
                try:
                    self.client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise


def request(request_id: str, now: float, *, age_s: float, **fields: Any) -> GenerateRequest:
    """A request created ``age_s`` before ``now``."""
    values: dict[str, Any] = {"model": "kimi-tiny", "tenant": "acme", "max_tokens": 256}
    values |= fields
    model, tenant = values.pop("model"), values.pop("tenant")
    return GenerateRequest(request_id, model, tenant, [1, 2, 3], created_at=now - age_s, **values)
