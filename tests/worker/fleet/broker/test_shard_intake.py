"""``shard_intake``: the budget split over shards (pure), and taking from 12 request shards on a real Redis
Cluster: never more than asked, every entry once, the shards served evenly over turns, each read sent to
its slot's primary (no ``COMMAND GETKEYS`` round for it)."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import redis

from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import Priority
from metrale.shared.redis_connect import sync_cluster_client
from metrale.worker.fleet.broker.cluster_router import SlotRouter
from metrale.worker.fleet.broker.shard_intake import node_reads, pipelined_reads, shares, take_from_shards
from tests.failover.cluster import ClusterGroup

INTERACTIVE = Priority.INTERACTIVE


def test_the_budget_is_split_with_the_first_shard_rotating() -> None:
    assert shares(10, 4, 0) == [(0, 3), (1, 3), (2, 2), (3, 2)]
    assert shares(10, 4, 1) == [(1, 3), (2, 3), (3, 2), (0, 2)]
    assert shares(2, 4, 3) == [(3, 1), (0, 1)]  # a shard given nothing is not asked
    assert shares(5, 1, 7) == [(0, 5)]
    assert sum(count for _, count in shares(37, 12, 5)) == 37


@pytest.mark.slow
def test_taking_from_twelve_shards_on_a_cluster(redis_cluster: ClusterGroup) -> None:
    client = sync_cluster_client(redis_cluster.url)
    router = SlotRouter(client)
    keys = Keys("met-intake", shards=12)
    for stream in keys.request_streams(INTERACTIVE):
        client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
        for index in range(10):
            client.xadd(stream, {"msg": f"{stream}/{index}".encode()})
    getkeys_before = getkeys_calls(redis_cluster)
    taken, per_turn = [], []
    for turn in range(12):  # 12 turns of 5: 60 of the 120 entries
        got = take_from_shards(node_reads(router, "w1"), keys, INTERACTIVE, 5, turn)
        per_turn.append(len(got))
        taken += got
    assert per_turn == [5] * 12
    assert sorted(Counter(stream for stream, _, _ in taken).values()) == [5] * 12  # each shard equally
    rest = take_from_shards(node_reads(router, "w2"), keys, INTERACTIVE, 1000, 0)
    fields = [entry[b"msg"] for _, _, entry in [*taken, *rest]]
    assert len(fields) == len(set(fields)) == 120  # every entry, once
    first = keys.request_stream(INTERACTIVE, 0)  # only shard 0 has work, and turn 4 does not start there
    for index in range(6):
        client.xadd(first, {"msg": b"late-%d" % index})
    late = [entry[b"msg"] for _, _, entry in take_from_shards(node_reads(router, "w3"), keys, INTERACTIVE, 5, 4)]
    assert late == [b"late-%d" % index for index in range(5)]  # the whole budget, from the one shard
    assert getkeys_calls(redis_cluster) == getkeys_before
    client.close()


def getkeys_calls(cluster: ClusterGroup) -> int:
    """``COMMAND GETKEYS`` calls every live node of ``cluster`` has answered so far."""
    calls = 0
    for port in cluster.live_ports():
        node = redis.Redis(port=port)
        calls += int(node.info("commandstats").get("cmdstat_command|getkeys", {}).get("calls", 0))
        node.close()
    return calls


def test_one_shard_on_one_redis_is_one_xreadgroup(real_redis_url: str) -> None:
    client = redis.Redis.from_url(real_redis_url)
    keys = Keys(f"met-intake-{uuid.uuid4().hex[:8]}")
    stream = keys.request_stream(INTERACTIVE)
    client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
    for index in range(7):
        client.xadd(stream, {"msg": b"%d" % index})
    reads = pipelined_reads(client, "w")
    assert [entry[b"msg"] for _, _, entry in take_from_shards(reads, keys, INTERACTIVE, 5, 3)] == [
        b"%d" % index for index in range(5)
    ]
    assert take_from_shards(reads, keys, INTERACTIVE, 0, 0) == []
    client.delete(stream)
    client.close()
