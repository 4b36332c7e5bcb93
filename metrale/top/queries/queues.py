"""The Queues panel: each priority's request streams (one per shard; one on a single Redis) summed —
their depth, what is taken but unacknowledged, the oldest waiting request; dead letters and the
gateways' 429s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metrale.shared.keys import QUEUE_FULL_FIELD, WORKER_GROUP, Keys
from metrale.shared.messages import Priority
from metrale.shared.redis_connect import SyncClient
from metrale.top.queries.replies import as_int, text


@dataclass(frozen=True, slots=True)
class QueueRow:
    """One priority's streams. ``length`` entries (XLEN: finished ones are deleted), ``pending`` taken
    by a worker and not yet acknowledged (XPENDING), ``waiting`` the rest; ``oldest_waiting_s`` how
    long the first waiting entry of any shard has waited (None when none waits)."""

    priority: Priority
    length: int
    pending: int
    oldest_waiting_s: float | None

    @property
    def waiting(self) -> int:
        return max(self.length - self.pending, 0)


@dataclass(frozen=True, slots=True)
class QueuesView:
    """Both priorities, the dead-letter streams' length and the 429s counted so far."""

    queues: tuple[QueueRow, ...]
    dead_letters: int
    rejected: int

    @property
    def waiting(self) -> int:
        return sum(row.waiting for row in self.queues)


@dataclass(frozen=True, slots=True)
class _StreamDepth:
    priority: Priority
    stream: str
    length: int
    pending: int
    last_delivered: str | None


def read_queues(client: SyncClient, keys: Keys, now: float) -> QueuesView:
    """Two pipelined rounds (on a cluster, one round trip per node each): every stream's length,
    pending count and group's last delivered id, the dead letters and the 429s; then the first entry
    after the last delivered one in each stream that has waiting entries."""
    streams = [(priority, stream) for priority in Priority for stream in keys.request_streams(priority)]
    with client.pipeline(transaction=False) as pipe:
        for _, stream in streams:
            pipe.xlen(stream)
            pipe.xpending(stream, WORKER_GROUP)
            pipe.xinfo_groups(stream)
        for dead_letters in keys.dead_letters():
            pipe.xlen(dead_letters)
        pipe.hget(keys.gateway_counters(), QUEUE_FULL_FIELD)
        replies = pipe.execute(raise_on_error=False)
    depths = []
    for position, (priority, stream) in enumerate(streams):
        length, pending, groups = replies[3 * position : 3 * position + 3]
        pending_count = pending["pending"] if isinstance(pending, dict) else 0
        depths.append(_StreamDepth(priority, stream, as_int(length), as_int(pending_count), _last_delivered(groups)))
    oldest = _oldest_waiting(client, now, depths)
    rows = []
    for priority in Priority:
        mine = [depth for depth in depths if depth.priority is priority]
        waited = [oldest[depth.stream] for depth in mine if depth.stream in oldest]
        length, pending = sum(depth.length for depth in mine), sum(depth.pending for depth in mine)
        rows.append(QueueRow(priority, length, pending, max(waited) if waited else None))
    counts = replies[3 * len(streams) :]
    dead = sum(as_int(count) for count in counts[:-1])
    return QueuesView(tuple(rows), dead, as_int(counts[-1]))


def _last_delivered(groups: Any) -> str | None:
    if not isinstance(groups, list):
        return None  # no stream yet (no worker opened it)
    for group in groups:
        if text(group.get("name")) == WORKER_GROUP:
            return text(group.get("last-delivered-id"))
    return None


def _oldest_waiting(client: SyncClient, now: float, depths: list[_StreamDepth]) -> dict[str, float]:
    """How long the first entry no worker took yet has waited, per stream with waiting entries."""
    asked = [depth for depth in depths if depth.length > depth.pending]
    if not asked:
        return {}
    with client.pipeline(transaction=False) as pipe:
        for depth in asked:
            start = f"({depth.last_delivered}" if depth.last_delivered is not None else "-"
            pipe.xrange(depth.stream, min=start, count=1)
        replies = pipe.execute(raise_on_error=False)
    oldest = {}
    for depth, entries in zip(asked, replies, strict=True):
        if isinstance(entries, list) and entries:
            entry_ms = int(str(text(entries[0][0])).split("-")[0])
            oldest[depth.stream] = max(0.0, now - entry_ms / 1000)
    return oldest
