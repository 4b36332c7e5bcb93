"""``d`` in ``met top`` orders a worker to drain, on one Redis and on a Redis Cluster (there by
``SPUBLISH`` to the worker's sharded control channel): a real worker hands back and exits, and a lost
worker's order finds nobody listening."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import redis.cluster

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import SyncClient, connect_sync
from metrale.top.app import TopApp
from metrale.top.source import RedisSource
from metrale.top.widgets import FleetTable
from metrale.worker.fleet.broker.redis_transport import RedisTransport
from metrale.worker.fleet.service import Worker
from tests.top.fake_fleet import FakeFleet
from tests.top.test_app import SIZE, keys_of, top
from tests.worker.worker_helpers import announcement, join_worker, make_engine, start_worker, wait_for, worker_settings

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def redis_url(any_redis_url: str) -> str:
    return any_redis_url


def listeners(client: SyncClient, channel: str) -> int:
    """Subscribers of ``channel``: a sharded one's on its shard's node on a cluster."""
    if isinstance(client, redis.cluster.RedisCluster):
        node = client.get_node_from_key(channel)
        return int(client.pubsub_shardnumsub(channel, target_nodes=node)[0][1])
    return int(client.pubsub_numsub(channel)[0][1])


async def test_d_drains_a_real_worker(client: SyncClient, keys: Keys, redis_url: str) -> None:
    """The order reaches a worker of ``tests/worker``: it hands back and exits, withdrawing its heartbeat."""
    engine, _ = make_engine()
    transport = RedisTransport(connect_sync(redis_url), worker_id="real-w", keys=keys, heartbeat_ttl_s=5)
    settings = dataclasses.replace(worker_settings(heartbeat_ttl_s=5), namespace=keys.namespace, drain_handoff=True)
    worker = Worker(engine, transport, settings, worker_id="real-w", model=announcement(), device="cpu")
    stop = threading.Event()
    thread = start_worker(worker, stop)
    wait_for(lambda: bool(client.exists(keys.worker("real-w"))), "the worker's heartbeat")
    wait_for(lambda: listeners(client, keys.control_channel("real-w")) == 1, "the worker to listen")

    app = TopApp(RedisSource(client, keys), interval=3600)
    async with app.run_test(size=SIZE) as pilot:
        assert keys_of(app.query_one(FleetTable)) == ["real-w"]
        app.query_one(FleetTable).focus()
        await pilot.press("d", "y")
        await pilot.pause()
        join_worker(thread, stop)  # returns by itself
        await app.refresh_now()
        assert keys_of(app.query_one(FleetTable)) == []  # withdrawn, not lost
    assert stop.is_set()


async def test_d_on_a_lost_worker_says_nobody_listens(scene: FakeFleet, client: SyncClient, keys: Keys) -> None:
    app = top(client, keys)
    async with app.run_test(size=SIZE) as pilot:
        fleet = app.query_one(FleetTable)
        fleet.focus()
        fleet.move_cursor(row=keys_of(fleet).index("gpu-d"))
        await pilot.press("d", "y")
        await pilot.pause()
        assert any("not listening" in str(n.message) for n in app._notifications)
