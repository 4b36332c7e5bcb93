"""Where the app gets its snapshots and sends its orders: a Redis client and a key space."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from metrale.shared.keys import Keys
from metrale.top.control import order_drain
from metrale.top.queries.requests import MAX_REQUESTS
from metrale.top.queries.snapshot import Snapshot, read_snapshot


@dataclass
class RedisSource:
    """Reads ``keys``' fleet through ``client`` (binary replies)."""

    client: redis.Redis
    keys: Keys
    max_requests: int = MAX_REQUESTS

    def read(self, now: float, previous: Snapshot | None) -> Snapshot:
        return read_snapshot(self.client, self.keys, now, previous=previous, max_requests=self.max_requests)

    def drain(self, worker_id: str) -> int:
        return order_drain(self.client, self.keys, worker_id)
