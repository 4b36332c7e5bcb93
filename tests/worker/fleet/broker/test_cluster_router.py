"""``SlotRouter`` on a real Redis Cluster (3 primaries + 3 replicas): a hand-packed transaction of one hash
tag runs on the primary owning its slot, with ``SPUBLISH`` reaching a sharded subscriber; a transaction
over two slots is refused by Redis and nothing of it runs; after a ``kill -9`` of the slot's primary the
next transaction runs on the promoted replica. The kill is the module's last test."""

from __future__ import annotations

import time

import pytest
import redis

from metrale.shared.redis_connect import sync_cluster_client
from metrale.worker.fleet.broker.cluster_router import SlotRouter
from metrale.worker.fleet.broker.resp import Transaction
from tests.failover.cluster import ClusterGroup

pytestmark = pytest.mark.slow

RECORD, EVENTS, CHANNEL = "met:test:run:{r7}", "met:test:run:{r7}:events", "met:test:out:{r7}"


def _step(seq: int) -> Transaction:
    transaction = Transaction()
    transaction.command("HSET", RECORD, "status", "running")
    transaction.command("RPUSH", EVENTS, f"event-{seq}")
    transaction.command("SPUBLISH", CHANNEL, f"event-{seq}")
    return transaction


def test_a_transaction_of_one_slot_runs_on_its_primary_and_its_spublish_is_heard(redis_cluster: ClusterGroup) -> None:
    client = sync_cluster_client(redis_cluster.url)
    router = SlotRouter(client)
    assert router.primary_for(RECORD).connection_pool.connection_kwargs["port"] == redis_cluster.primary_port_of(RECORD)
    pubsub = client.pubsub()
    pubsub.ssubscribe(CHANNEL)
    assert router.execute(RECORD, _step(0)) == [1, 1, 1]  # a new field, a list of one, one subscriber
    assert client.lrange(EVENTS, 0, -1) == [b"event-0"] and client.hget(RECORD, "status") == b"running"
    deadline = time.monotonic() + 5
    message = None
    while message is None and time.monotonic() < deadline:
        message = pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=0.5)
    assert message is not None and message["data"] == b"event-0"
    pubsub.close()
    client.close()


def test_a_transaction_over_two_slots_is_refused_and_runs_nothing(redis_cluster: ClusterGroup) -> None:
    client = sync_cluster_client(redis_cluster.url)
    transaction = Transaction()
    transaction.command("SET", "met:test:{a}", "1")
    transaction.command("SET", "met:test:{b}", "1")
    if redis_cluster.primary_port_of("met:test:{a}") == redis_cluster.primary_port_of("met:test:{b}"):
        pytest.fail("the test's two keys must live on different primaries")
    with pytest.raises(redis.ResponseError):
        SlotRouter(client, retries=1).execute("met:test:{a}", transaction)
    assert client.get("met:test:{a}") is None and client.get("met:test:{b}") is None
    client.close()


def test_after_the_primary_is_killed_the_next_transaction_runs_on_the_promoted_replica(
    redis_cluster: ClusterGroup,
) -> None:
    client = sync_cluster_client(redis_cluster.url)
    router = SlotRouter(client)
    router.execute(RECORD, _step(1))
    with redis.Redis(port=redis_cluster.primary_port_of(RECORD)) as primary:
        assert primary.wait(1, 2000) == 1
    old = redis_cluster.kill_primary_of(RECORD)
    began = time.monotonic()
    router.execute(RECORD, _step(2))  # retried with backoff until a replica owns the slot
    took = time.monotonic() - began
    assert redis_cluster.primary_port_of(RECORD) != old
    assert router.primary_for(RECORD).connection_pool.connection_kwargs["port"] != old
    assert client.lrange(EVENTS, -2, -1) == [b"event-1", b"event-2"]
    assert took < 20, f"the transaction waited {took:.1f} s for the promotion"
    client.close()
