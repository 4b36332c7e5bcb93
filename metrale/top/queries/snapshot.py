"""Everything ``met top`` shows at one moment, read panel by panel."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import SyncClient
from metrale.top.queries.batches import BatchesView, read_batches
from metrale.top.queries.counters import CountersView, read_counters
from metrale.top.queries.fleet import FleetView, read_fleet
from metrale.top.queries.queues import QueuesView, read_queues
from metrale.top.queries.requests import MAX_REQUESTS, RequestsView, read_requests


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One refresh: the fleet, the queues, the requests in flight, the counters, the batches."""

    at: float
    fleet: FleetView
    queues: QueuesView
    requests: RequestsView
    counters: CountersView
    batches: BatchesView


def read_snapshot(
    client: SyncClient,
    keys: Keys,
    now: float,
    *,
    previous: Snapshot | None = None,
    max_requests: int = MAX_REQUESTS,
    jobs: redis.Redis | None = None,
) -> Snapshot:
    """Every panel's query; ``previous`` (the last refresh) gives the requests' recent rates, ``jobs``
    is RQ's Redis when it is not the fleet's (``read_batches``)."""
    before = previous.requests if previous is not None else None
    return Snapshot(
        at=now,
        fleet=read_fleet(client, keys, now),
        queues=read_queues(client, keys, now),
        requests=read_requests(client, keys, now, previous=before, limit=max_requests),
        counters=read_counters(client, keys),
        batches=read_batches(client, keys, jobs=jobs),
    )
