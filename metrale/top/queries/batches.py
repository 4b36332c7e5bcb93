"""The Batches panel: every unfinished batch (``met:active-batches``) with its counts, and the RQ
queue of batch jobs (queued, and started by a batch runner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis
from rq import Queue
from rq.registry import StartedJobRegistry

from metrale.shared.keys import Keys
from metrale.top.queries.replies import as_int, text

MAX_BATCHES = 100
"""The most batches one read shows (the oldest first)."""
_FIELDS = ("status", "total", "completed", "failed", "created_at", "in_progress_at")


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One unfinished batch: its lines answered (``completed``), answered with an error (``failed``),
    of ``total`` (0 while it is validated)."""

    tenant: str
    batch_id: str
    status: str
    total: int
    completed: int
    failed: int
    created_at: int
    in_progress_at: int | None

    @property
    def done(self) -> int:
        return self.completed + self.failed

    def eta_s(self, now: float) -> float | None:
        """When the rest should be done at the pace so far (None before any line is)."""
        if self.in_progress_at is None or not self.done or not self.total:
            return None
        elapsed = max(now - self.in_progress_at, 0.0)
        return elapsed / self.done * max(self.total - self.done, 0)


@dataclass(frozen=True, slots=True)
class BatchesView:
    """Unfinished batches, and the batch jobs RQ holds: waiting for a runner, and running."""

    batches: tuple[BatchRow, ...]
    queued_jobs: int
    running_jobs: int


def read_batches(client: redis.Redis, keys: Keys, *, limit: int = MAX_BATCHES) -> BatchesView:
    """Two round trips: the index and RQ's queue and started registry, then each batch's counts."""
    queue = Queue(keys.batch_queue(), connection=client)
    with client.pipeline(transaction=False) as pipe:
        pipe.zrange(keys.active_batches(), 0, limit - 1)
        pipe.llen(queue.key)
        pipe.zcard(StartedJobRegistry(queue=queue).key)
        members, queued, running = pipe.execute()
    active = [str(text(member)).partition(":") for member in cast(list[bytes], members)]
    with client.pipeline(transaction=False) as pipe:
        for tenant, _, batch_id in active:
            pipe.hmget(keys.batch(tenant, batch_id), _FIELDS)
        replies = pipe.execute()
    rows = []
    for (tenant, _, batch_id), fields in zip(active, replies, strict=True):
        status, total, completed, failed, created, started = (text(value) for value in fields)
        if status is None:
            continue  # deleted meanwhile
        started_at = as_int(started) if started is not None else None
        counts = (as_int(total), as_int(completed), as_int(failed))
        rows.append(BatchRow(tenant, batch_id, status, *counts, as_int(created), started_at))
    return BatchesView(tuple(rows), as_int(queued), as_int(running))
