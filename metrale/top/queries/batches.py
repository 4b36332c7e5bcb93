"""The Batches panel: every unfinished batch (``met:active-batches``) with its counts, and the RQ
queue of batch jobs (queued, and started by a batch runner), read from RQ's own Redis
(``MET_JOBS_REDIS_URL``; the fleet's own unless that is a Redis Cluster, where RQ cannot run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis
from rq import Queue
from rq.registry import StartedJobRegistry

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import SyncClient, is_cluster
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
    """Unfinished batches, and the batch jobs RQ holds: waiting for a runner, and running (None: no
    job queue Redis to read them from)."""

    batches: tuple[BatchRow, ...]
    queued_jobs: int | None
    running_jobs: int | None


def read_batches(
    client: SyncClient, keys: Keys, *, jobs: redis.Redis | None = None, limit: int = MAX_BATCHES
) -> BatchesView:
    """Two round trips to the fleet's Redis (on a cluster, the control keys' node, then one per node
    holding the batches' tenants): the index, then each batch's counts; one to RQ's, ``jobs`` (None:
    the fleet's own, unless it is a cluster: no job counts then), for its queue and started registry."""
    rq = jobs if jobs is not None else (None if is_cluster(client) else cast(redis.Redis, client))
    queued, running = _job_counts(rq, keys) if rq is not None else (None, None)
    members = client.zrange(keys.active_batches(), 0, limit - 1)
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
    return BatchesView(tuple(rows), queued, running)


def _job_counts(jobs: redis.Redis, keys: Keys) -> tuple[int, int]:
    """Batch jobs waiting in RQ's queue, and started by a runner."""
    queue = Queue(keys.batch_queue(), connection=jobs)
    with jobs.pipeline(transaction=False) as pipe:
        pipe.llen(queue.key)
        pipe.zcard(StartedJobRegistry(queue=queue).key)
        queued, running = pipe.execute()
    return as_int(queued), as_int(running)
