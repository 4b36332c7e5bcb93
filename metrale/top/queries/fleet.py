"""The Fleet panel: one row per worker in the worker index, live or lost."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

from metrale.shared.heartbeats import HEARTBEAT_FIELD, parse_heartbeat
from metrale.shared.keys import Keys
from metrale.shared.messages import WorkerHeartbeat, WorkerState
from metrale.shared.redis_connect import SyncClient

MAX_WORKERS = 1000
"""The most workers one read shows (the most recently beating first)."""

_decoded = functools.lru_cache(maxsize=4 * MAX_WORKERS)(parse_heartbeat)
"""Heartbeats decoded before, by their bytes: a worker beats every third of its TTL, a refresh comes
every second, so most heartbeats a refresh reads are the ones the last one decoded."""


class RowState(StrEnum):
    """A worker as ``met top`` shows it: taking, draining, or lost (in the index, heartbeat expired
    without being withdrawn: it died, or lost Redis)."""

    TAKING = "taking"
    DRAINING = "draining"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """One worker: its last heartbeat (None when lost) and when it last beat."""

    worker_id: str
    state: RowState
    last_beat: float
    heartbeat: WorkerHeartbeat | None

    def heartbeat_age_s(self, now: float) -> float:
        return max(0.0, now - self.last_beat)


@dataclass(frozen=True, slots=True)
class FleetView:
    """Every worker read, live ones first (by id), then the lost ones (most recent first)."""

    at: float
    workers: tuple[WorkerRow, ...]

    @property
    def tokens_per_s(self) -> float:
        """What the live workers generate together, per second."""
        return sum(row.heartbeat.tokens_per_s for row in self.workers if row.heartbeat is not None)

    def worker(self, worker_id: str) -> WorkerRow | None:
        return next((row for row in self.workers if row.worker_id == worker_id), None)


def read_fleet(client: SyncClient, keys: Keys, now: float, *, limit: int = MAX_WORKERS) -> FleetView:
    """Two round trips: the index (newest first), then every indexed worker's heartbeat."""
    indexed = cast(list[tuple[bytes, float]], client.zrevrange(keys.worker_index(), 0, limit - 1, withscores=True))
    ids = [raw.decode() for raw, _ in indexed]
    with client.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hget(keys.worker(worker_id), HEARTBEAT_FIELD)
        payloads = pipe.execute()
    rows = []
    for worker_id, (_, score), payload in zip(ids, indexed, payloads, strict=True):
        beat = _decoded(payload)
        if beat is None:
            rows.append(WorkerRow(worker_id, RowState.LOST, score, None))
        else:
            state = RowState.DRAINING if beat.state is WorkerState.DRAINING else RowState.TAKING
            rows.append(WorkerRow(worker_id, state, beat.sent_at, beat))
    live = sorted((row for row in rows if row.heartbeat is not None), key=lambda row: row.worker_id)
    lost = [row for row in rows if row.heartbeat is None]
    return FleetView(now, (*live, *lost))
