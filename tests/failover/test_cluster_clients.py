"""``redis_connect``'s cluster clients on a real Redis Cluster (three primaries, three replicas): keys land
on the shard owning their slot, a transaction stays within one hash tag's slot, sharded pub/sub
(``SPUBLISH``/``SSUBSCRIBE``) reaches its subscriber, and commands and sharded subscriptions follow a
``kill -9`` of a primary to the replica the cluster promotes. The processes that cannot run on a cluster
yet refuse its URL with a reason. The kill is the module's last test: it leaves the cluster a replica
short."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
import redis
from redis.cluster import key_slot

from metrale.shared.keys import CLUSTER_SHARDS
from metrale.shared.redis_connect import async_client, async_cluster_client, sync_client, sync_cluster_client
from metrale.shared.redis_url import CLUSTER_NOT_SERVED
from metrale.shared.settings import load_settings
from metrale.shared.slots import spread_tags
from tests.failover.cluster import ClusterGroup

pytestmark = pytest.mark.slow

RECORD = "met:test:run:{r1}"
EVENTS = "met:test:run:{r1}:events"
CHANNEL = "met:test:out:{r1}"


def test_keys_spread_over_the_primaries_and_a_hash_tag_keeps_a_transaction_on_one(
    redis_cluster: ClusterGroup,
) -> None:
    client = sync_cluster_client(redis_cluster.url)
    for index in range(30):
        client.set(f"met:test:spread:{index}", index)
    holders = {redis_cluster.primary_port_of(f"met:test:spread:{index}") for index in range(30)}
    assert holders == set(redis_cluster.primary_ports()) and len(holders) == 3
    assert key_slot(RECORD.encode()) == key_slot(EVENTS.encode()) == key_slot(CHANNEL.encode())
    with client.pipeline(transaction=True) as transaction:
        transaction.hset(RECORD, "status", "running").rpush(EVENTS, b"e1").execute()
    assert client.hget(RECORD, "status") == b"running" and client.lrange(EVENTS, 0, -1) == [b"e1"]
    with pytest.raises(redis.RedisClusterException), client.pipeline(transaction=True) as transaction:
        transaction.set("met:test:a", 1).set("met:test:b", 2).execute()  # two slots: refused
    client.close()


def test_shard_tags_fall_evenly_on_the_primaries(redis_cluster: ClusterGroup) -> None:
    client = sync_cluster_client(redis_cluster.url)
    holders = Counter(redis_cluster.primary_port_of(f"met:test:req:{{{tag}}}") for tag in spread_tags(12))
    assert sorted(holders.values()) == [4, 4, 4] and set(holders) == set(redis_cluster.primary_ports())
    for tag in spread_tags(12):  # and the client writes each where the cluster keeps it
        client.xadd(f"met:test:req:{{{tag}}}:interactive", {"msg": tag})
    client.close()


def test_asyncio_sharded_pubsub_reaches_its_subscriber(redis_cluster: ClusterGroup) -> None:
    async def scenario() -> bytes:
        client = async_cluster_client(redis_cluster.url)
        pubsub = client.pubsub()
        await pubsub.ssubscribe(CHANNEL)
        heard = await _spublish_until_heard(client, pubsub)
        await pubsub.aclose()
        await client.aclose()
        return heard

    assert asyncio.run(scenario()) == b"hello"


def test_the_single_server_clients_refuse_a_cluster_url_and_the_settings_shard_its_keys(
    redis_cluster: ClusterGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=re.escape(CLUSTER_NOT_SERVED)):
        sync_client(redis_cluster.url)
    with pytest.raises(ValueError, match=re.escape(CLUSTER_NOT_SERVED)):
        async_client(redis_cluster.url)
    with pytest.raises(ValueError, match="needs a redis\\+cluster:// URL"):
        sync_cluster_client("redis://127.0.0.1:6379")
    monkeypatch.setenv("MET_REDIS_URL", redis_cluster.url)
    assert load_settings().gateway().keys.shards == CLUSTER_SHARDS
    assert load_settings().worker().keys.shards == CLUSTER_SHARDS


def test_commands_and_a_sharded_subscription_follow_the_promoted_replica(redis_cluster: ClusterGroup) -> None:
    async def scenario() -> tuple[bytes | None, bytes | None, bytes]:
        client = async_cluster_client(redis_cluster.url)
        pubsub = client.pubsub()
        await pubsub.ssubscribe(CHANNEL)
        await _spublish_until_heard(client, pubsub)
        await client.set(RECORD, "before")
        primary = redis_cluster.primary_port_of(RECORD)
        with redis.Redis(port=primary) as direct:  # on the replica before the kill
            assert direct.wait(1, 2000) == 1
        old = await asyncio.to_thread(redis_cluster.kill_primary_of, RECORD)
        await _until_served(lambda: client.set(EVENTS, "after"))
        assert redis_cluster.primary_port_of(RECORD) != old
        heard = await _spublish_until_heard(client, pubsub)
        before, after = await client.get(RECORD), await client.get(EVENTS)
        await pubsub.aclose()
        await client.aclose()
        return before, after, heard

    assert asyncio.run(scenario()) == (b"before", b"after", b"hello")


async def _until_served(command: Callable[[], Awaitable[object]], timeout_s: float = 30.0) -> None:
    """Call ``command`` until it succeeds: each call retries with backoff, then raises."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await command()
            return
        except (redis.ConnectionError, redis.TimeoutError, redis.ClusterDownError, redis.RedisClusterException):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _spublish_until_heard(
    client: redis.asyncio.cluster.RedisCluster, pubsub: redis.asyncio.cluster.ClusterPubSub, timeout_s: float = 30.0
) -> bytes:
    """Publish on ``CHANNEL`` until the sharded subscription hears it (it resubscribes after a failover)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await client.spublish(CHANNEL, "hello")
        except (redis.ConnectionError, redis.TimeoutError, redis.ClusterDownError):
            await asyncio.sleep(0.1)
            continue
        message = await pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=0.5)
        if message is not None:
            return bytes(message["data"])
    raise AssertionError(f"the sharded subscription heard nothing within {timeout_s} s")
