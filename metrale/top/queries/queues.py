"""The Queues panel: each request stream's depth, what is taken but unacknowledged, the oldest
waiting request; dead letters and the gateways' 429s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from metrale.shared.keys import QUEUE_FULL_FIELD, WORKER_GROUP, Keys
from metrale.shared.messages import Priority
from metrale.top.queries.replies import as_int, text


@dataclass(frozen=True, slots=True)
class QueueRow:
    """One request stream. ``length`` entries (XLEN: finished ones are deleted), ``pending`` taken
    by a worker and not yet acknowledged (XPENDING), ``waiting`` the rest; ``oldest_waiting_s`` how
    long the first waiting entry has waited (None when none waits)."""

    priority: Priority
    length: int
    pending: int
    oldest_waiting_s: float | None

    @property
    def waiting(self) -> int:
        return max(self.length - self.pending, 0)


@dataclass(frozen=True, slots=True)
class QueuesView:
    """Both request streams, the dead-letter stream's length and the 429s counted so far."""

    queues: tuple[QueueRow, ...]
    dead_letters: int
    rejected: int

    @property
    def waiting(self) -> int:
        return sum(row.waiting for row in self.queues)


def read_queues(client: redis.Redis, keys: Keys, now: float) -> QueuesView:
    """Two round trips: lengths, pending counts and each group's last delivered id; then the first
    entry after it in each stream that has waiting entries."""
    priorities = list(Priority)
    with client.pipeline(transaction=False) as pipe:
        for priority in priorities:
            stream = keys.request_stream(priority)
            pipe.xlen(stream)
            pipe.xpending(stream, WORKER_GROUP)
            pipe.xinfo_groups(stream)
        pipe.xlen(keys.dead_letter())
        pipe.hget(keys.gateway_counters(), QUEUE_FULL_FIELD)
        replies = pipe.execute(raise_on_error=False)
    streams = []
    for position, priority in enumerate(priorities):
        length, pending, groups = replies[3 * position : 3 * position + 3]
        pending_count = pending["pending"] if isinstance(pending, dict) else 0
        streams.append((priority, as_int(length), as_int(pending_count), _last_delivered(groups)))
    oldest = _oldest_waiting(client, keys, now, streams)
    rows = tuple(QueueRow(p, length, pending, oldest.get(p)) for p, length, pending, _ in streams)
    dead, rejected = replies[-2:]
    return QueuesView(rows, as_int(dead), as_int(rejected))


def _last_delivered(groups: Any) -> str | None:
    if not isinstance(groups, list):
        return None  # no stream yet (no worker opened it)
    for group in groups:
        if text(group.get("name")) == WORKER_GROUP:
            return text(group.get("last-delivered-id"))
    return None


def _oldest_waiting(
    client: redis.Redis, keys: Keys, now: float, streams: list[tuple[Priority, int, int, str | None]]
) -> dict[Priority, float]:
    """How long the first entry no worker took yet has waited, per stream with waiting entries."""
    asked = [(priority, last) for priority, length, pending, last in streams if length > pending]
    if not asked:
        return {}
    with client.pipeline(transaction=False) as pipe:
        for priority, last in asked:
            start = f"({last}" if last is not None else "-"
            pipe.xrange(keys.request_stream(priority), min=start, count=1)
        replies = pipe.execute(raise_on_error=False)
    oldest = {}
    for (priority, _), entries in zip(asked, replies, strict=True):
        if isinstance(entries, list) and entries:
            entry_ms = int(str(text(entries[0][0])).split("-")[0])
            oldest[priority] = max(0.0, now - entry_ms / 1000)
    return oldest
