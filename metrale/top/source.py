"""Where the app gets its snapshots and sends its orders: a Redis client (one Redis, Sentinel or a
Redis Cluster), a key space, and RQ's Redis when it is another."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import SyncClient
from metrale.top.control import order_drain
from metrale.top.queries.requests import MAX_REQUESTS
from metrale.top.queries.snapshot import Snapshot, read_snapshot


@dataclass
class RedisSource:
    """Reads ``keys``' fleet through ``client`` (binary replies), its batch jobs through ``jobs`` (None:
    ``client``, unless that is a cluster)."""

    client: SyncClient
    keys: Keys
    max_requests: int = MAX_REQUESTS
    jobs: redis.Redis | None = None

    def read(self, now: float, previous: Snapshot | None) -> Snapshot:
        return read_snapshot(
            self.client, self.keys, now, previous=previous, max_requests=self.max_requests, jobs=self.jobs
        )

    def drain(self, worker_id: str) -> int:
        return order_drain(self.client, self.keys, worker_id)
