"""Taking over the requests of workers that died: their stream entries, still pending in the group.

An entry is an orphan when the consumer that holds it has no heartbeat key (``met:worker:{wid}``
expired: it stopped beating at least one heartbeat TTL ago) and it has been idle for at least
``min_idle_ms`` since its last delivery. Both together: the heartbeat alone would let a worker that has
not sent its first beat yet lose what it just took; idle time alone (plain ``XAUTOCLAIM``) would take
long requests away from live workers, whose entries stay idle while they stream. Entries this
process holds under its own name but did not take (an earlier process with the same worker id) are
orphans too. ``XCLAIM`` with the same ``min_idle_ms`` settles races: of two workers claiming one
entry, the second finds it no longer idle and gets nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, cast

import redis
import redis.cluster
from redis.typing import StreamIdT

from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import Priority

logger = logging.getLogger(__name__)

SCAN_COUNT = 256
"""Pending entries looked at per stream and pass."""


@dataclass(frozen=True, slots=True)
class TakenEntry:
    """A stream entry handed to this worker: by ``XREADGROUP`` (first delivery) or ``XCLAIM``."""

    stream: str
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int


class Reclaimer:
    """Claims orphaned entries for ``worker_id``, at most once every ``every_s`` seconds."""

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster,
        keys: Keys,
        worker_id: str,
        *,
        min_idle_ms: int,
        every_s: float,
    ) -> None:
        self._client = client
        self._keys = keys
        self._worker_id = worker_id
        self.min_idle_ms = min_idle_ms
        self._every_s = every_s
        self._next_pass = 0.0

    def claim(self, limit: int, own_entries: Collection[str]) -> list[TakenEntry]:
        """Up to ``limit`` orphans (none when the last pass was too recent); ``own_entries`` are the
        entry ids this process is serving. Raises ``redis.ResponseError`` ``NOGROUP`` on a fresh Redis."""
        now = time.monotonic()
        if limit <= 0 or now < self._next_pass:
            return []
        self._next_pass = now + self._every_s
        claimed: list[TakenEntry] = []
        for priority in Priority:  # every shard of a priority (a Redis Cluster's) before the next priority
            for stream in self._keys.request_streams(priority):
                if len(claimed) < limit:
                    claimed += self._claim_from(stream, limit - len(claimed), own_entries)
        if claimed:
            logger.warning("took over %d requests of lost workers", len(claimed))
        return claimed

    def _claim_from(self, stream: str, limit: int, own_entries: Collection[str]) -> list[TakenEntry]:
        # No IDLE filter when any idle time will do: fakeredis compares it strictly, so with IDLE 0 it
        # leaves out an entry delivered in the same millisecond (Redis keeps it).
        idle = self.min_idle_ms if self.min_idle_ms > 0 else None
        pending = cast(
            list[dict[str, Any]],
            self._client.xpending_range(stream, WORKER_GROUP, min="-", max="+", count=SCAN_COUNT, idle=idle),
        )
        if not pending:
            return []
        lost = self._lost_consumers({_text(entry["consumer"]) for entry in pending})
        deliveries = {
            _text(entry["message_id"]): int(entry["times_delivered"]) + 1
            for entry in pending
            if self._is_orphan(_text(entry["consumer"]), _text(entry["message_id"]), lost, own_entries)
        }
        if not deliveries:
            return []
        ids: list[StreamIdT] = [entry_id for entry_id in itertools.islice(deliveries, limit)]
        replies = cast(
            list[tuple[bytes, dict[bytes, bytes] | None]],
            self._client.xclaim(stream, WORKER_GROUP, self._worker_id, self.min_idle_ms, ids),
        )
        return [
            TakenEntry(stream, _text(entry_id), fields, deliveries[_text(entry_id)])
            for entry_id, fields in replies
            if fields is not None  # deleted meanwhile
        ]

    def _is_orphan(self, consumer: str, entry_id: str, lost: set[str], own_entries: Collection[str]) -> bool:
        if consumer == self._worker_id:
            return entry_id not in own_entries
        return consumer in lost

    def _lost_consumers(self, consumers: set[str]) -> set[str]:
        """The consumers among ``consumers`` (other than this worker) without a heartbeat."""
        others = sorted(consumers - {self._worker_id})
        with self._client.pipeline(transaction=False) as pipe:
            for consumer in others:
                pipe.exists(self._keys.worker(consumer))
            alive = pipe.execute()
        return {consumer for consumer, exists in zip(others, alive, strict=True) if not exists}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
