"""A real Redis (db 15, own namespace; ``test_queries.py`` also a Redis Cluster) and a fake fleet written
into it at a pinned moment."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from metrale.shared.keys import Keys
from metrale.shared.messages import Priority, WorkerState
from metrale.shared.redis_connect import SyncClient, connect_sync
from tests.top.fake_fleet import FakeFleet, request

NOW = 1_790_000_000.0
"""The pinned moment every top test looks at the fleet (2026-09-21)."""


@pytest.fixture
def redis_url(real_redis_url: str) -> str:
    """The Redis the fake fleet is written to and read from (a module may run over ``any_redis_url``)."""
    return real_redis_url


@pytest.fixture
def keys(redis_url: str) -> Keys:
    return Keys.for_redis(redis_url, f"top-test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def client(redis_url: str) -> Iterator[SyncClient]:
    client = connect_sync(redis_url)
    yield client
    client.close()


@pytest.fixture
def fleet(client: SyncClient, keys: Keys) -> FakeFleet:
    return FakeFleet(client, keys, NOW)


def populate(fleet: FakeFleet) -> None:
    """The scene the panel tests and the snapshot look at: three live workers (one draining, one
    speculating), one lost, five requests running on two models and two tenants, three waiting,
    counters, two batches."""
    now = fleet.now
    speculating = [("resumed_requests", 2), ("spec_accepted_tokens", 620), ("spec_draft_tokens", 1000)]
    fleet.worker(
        "gpu-a", device="cuda:0", tokens_per_s=812.4, running=3, free_slots=61, total_slots=64, counters=speculating
    )
    fleet.worker("gpu-b", device="cuda:1", tokens_per_s=640.0, running=2, free_slots=62, total_slots=64, age_s=2.5)
    fleet.worker("cpu-c", model="kimi-small", state=WorkerState.DRAINING, tokens_per_s=31.0, running=0, waiting=0)
    fleet.lost_worker("gpu-d", age_s=45.0)
    # Stream entries are dated by creation: each stream's are submitted oldest first.
    small = {"model": "kimi-small", "tenant": "globex"}
    fleet.take("gpu-b", [request("chat-4", now, age_s=60.0, **small)], tokens=300, taken_ago_s=50.0)
    fleet.take("gpu-a", [request("chat-2", now, age_s=30.0, tenant="globex")], tokens=120, taken_ago_s=28.0)
    fleet.take("gpu-a", [request("chat-1", now, age_s=12.0)], tokens=100, taken_ago_s=10.0)
    fleet.take("gpu-b", [request("chat-3", now, age_s=9.0)], tokens=9, taken_ago_s=3.0)
    fleet.take("gpu-a", [request("batch-1", now, age_s=90.0, priority=Priority.BATCH)], tokens=40, taken_ago_s=80.0)
    fleet.submit(request("wait-1", now, age_s=7.5))
    fleet.submit(request("wait-2", now, age_s=2.0))
    fleet.submit(request("wait-b", now, age_s=33.0, priority=Priority.BATCH))
    fleet.counters(
        checkpoints={"lookups": 40, "hits": 30, "tokens_reused": 51200, "miss:none": 8, "miss:token_mismatch": 2},
        failover={"resumed_requests": 3, "handed_back_requests": 5, "unresumable_requests": 1},
    )
    fleet.dead_letter("not a msgpack payload")
    fleet.rejected(17)
    fleet.batch("acme", "batch_abc", total=200, completed=50, failed=2, running_s=100.0)
    fleet.batch("globex", "batch_xyz", total=1000, completed=0, failed=0, running_s=3.0)


@pytest.fixture
def scene(fleet: FakeFleet) -> FakeFleet:
    populate(fleet)
    return fleet
