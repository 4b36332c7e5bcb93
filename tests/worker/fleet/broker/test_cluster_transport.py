"""The worker's transport and the gateway's dispatcher on a real Redis Cluster (issue #34): requests
submitted to every shard are taken priority by priority, published per shard and per reply channel
(``SPUBLISH``), finished in their own slots, cancelled by sharded pub/sub; a publish that may have run
is written again only where the shard's primary lacks it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
import redis.cluster

from metrale.gateway.fleet.dispatcher import Dispatcher
from metrale.shared.codec import decode
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import FinishReason, GenerateRequest, Priority, TokenEvent, TokenEventGroup
from metrale.shared.record import RunStatus, read_record
from metrale.shared.redis_connect import connect_async, connect_sync
from metrale.worker.fleet.broker.redis_transport import RedisTransport
from metrale.worker.fleet.transport import FinishedRequest, Redelivery, StartedRequest
from tests.failover.cluster import ClusterGroup

WORKER_ID = "worker-c"
RELAY = "relay-c"


@pytest.fixture
def keys(redis_cluster: ClusterGroup) -> Keys:
    return Keys.for_redis(redis_cluster.url, f"met-ct-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def client(redis_cluster: ClusterGroup) -> Iterator[redis.cluster.RedisCluster]:
    client = connect_sync(redis_cluster.url)
    assert isinstance(client, redis.cluster.RedisCluster)
    yield client
    client.close()


@pytest.fixture
def transport(redis_cluster: ClusterGroup, keys: Keys) -> RedisTransport:
    return RedisTransport(connect_sync(redis_cluster.url), worker_id=WORKER_ID, keys=keys, heartbeat_ttl_s=30)


def request(request_id: str, priority: Priority = Priority.INTERACTIVE) -> GenerateRequest:
    return GenerateRequest(request_id, "tiny", "default", [1, 2, 3], max_tokens=4, priority=priority, reply_to=RELAY)


def submit(url: str, keys: Keys, requests: list[GenerateRequest]) -> None:
    async def run() -> None:
        client = connect_async(url)
        dispatcher = Dispatcher(client, keys)
        for message in requests:
            await dispatcher.submit(message)
        await client.aclose()

    asyncio.run(run())


def take_all(transport: RedisTransport, count: int, max_new: int) -> list[GenerateRequest]:
    taken: list[GenerateRequest] = []
    deadline = time.monotonic() + 10
    while len(taken) < count and time.monotonic() < deadline:
        taken += [item for item in transport.receive(max_new, block_ms=20) if isinstance(item, GenerateRequest)]
    return taken


def test_every_shard_is_taken_interactive_first_and_finished_in_its_slot(
    redis_cluster: ClusterGroup, client: redis.cluster.RedisCluster, keys: Keys, transport: RedisTransport
) -> None:
    interactive = [request(f"inter-{i}") for i in range(24)]
    batch = [request(f"batch-{i}", Priority.BATCH) for i in range(6)]
    assert len({keys.shard_of(message.request_id) for message in interactive}) >= 8  # spread over the shards
    transport.receive(0, block_ms=0)  # makes the consumer groups
    submit(redis_cluster.url, keys, [*batch, *interactive])
    pubsub = client.pubsub()
    pubsub.ssubscribe(keys.reply_channel(RELAY))

    first = take_all(transport, 24, max_new=24)
    second = take_all(transport, 6, max_new=24)

    assert sorted(m.request_id for m in first) == sorted(m.request_id for m in interactive)
    assert sorted(m.request_id for m in second) == sorted(m.request_id for m in batch)
    taken = [*first, *second]
    transport.begin([StartedRequest(m.request_id, 7, 0) for m in taken])
    events = [TokenEvent(m.request_id, 0, 0, [5, 6], WORKER_ID) for m in taken]
    transport.publish(events, [])
    finals = [
        TokenEvent(m.request_id, 0, 1, [7], WORKER_ID, finished=True, finish_reason=FinishReason.LENGTH) for m in taken
    ]
    transport.publish(finals, [FinishedRequest(m.request_id, FinishReason.LENGTH) for m in taken])

    for message in taken:
        record = read_record(client, message.request_id, keys=keys)
        assert record is not None and record.status is RunStatus.FINISHED and record.seed == 7
        assert [event.seq for event in record.events] == [0, 1] and record.token_ids() == [5, 6, 7]
    for priority in Priority:
        for stream in keys.request_streams(priority):
            assert client.xlen(stream) == 0 and client.xpending(stream, WORKER_GROUP)["pending"] == 0
    assert sum(client.zcard(keys.running_index(shard)) for shard in range(keys.shards)) == 0
    heard: list[TokenEvent] = []
    deadline = time.monotonic() + 10
    while len(heard) < 2 * len(taken) and time.monotonic() < deadline:
        message = pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=0.1)
        if message is not None:
            group = decode(message["data"])
            assert isinstance(group, TokenEventGroup)
            heard += [event for raw in group.events if isinstance(event := decode(raw), TokenEvent)]
    pubsub.close()
    assert sorted((e.request_id, e.seq) for e in heard) == sorted((m.request_id, s) for m in taken for s in (0, 1))


def test_a_publish_that_may_have_run_is_written_again_only_where_it_is_missing(
    redis_cluster: ClusterGroup, client: redis.cluster.RedisCluster, keys: Keys, transport: RedisTransport
) -> None:
    messages = [request(f"again-{i}") for i in range(12)]
    transport.receive(0, block_ms=0)
    submit(redis_cluster.url, keys, messages)
    taken = take_all(transport, 12, max_new=12)
    written = [TokenEvent(m.request_id, 0, 0, [1], WORKER_ID) for m in taken]
    transport.publish(written, [])

    # As after transactions cut off with their primaries: each shard written may or may not hold them.
    shards = {keys.shard_of(m.request_id) for m in taken}
    transport._unsure_shards.update(shards)
    transport.publish(written, [])  # repeated as the worker repeats a failed publish: already there
    transport._unsure_shards.update(shards)
    newer = [TokenEvent(m.request_id, 0, 1, [2], WORKER_ID) for m in taken]
    transport.publish(newer, [])  # not there yet: written

    for message in taken:
        record = read_record(client, message.request_id, keys=keys)
        assert record is not None and [event.seq for event in record.events] == [0, 1]
    assert not transport._unsure_shards


def test_a_cancel_reaches_the_worker_by_sharded_pubsub(
    redis_cluster: ClusterGroup, keys: Keys, transport: RedisTransport
) -> None:
    transport.cancellations()  # subscribes

    async def cancel() -> None:
        client = connect_async(redis_cluster.url)
        await Dispatcher(client, keys).cancel("inter-0", "client gone")
        await client.aclose()

    asyncio.run(cancel())
    heard: list[str] = []
    deadline = time.monotonic() + 10
    while not heard and time.monotonic() < deadline:
        heard = transport.cancellations()
        time.sleep(0.02)
    assert heard == ["inter-0"]


def test_a_cluster_transport_refuses_a_plain_key_space(redis_cluster: ClusterGroup) -> None:
    with pytest.raises(ValueError, match="sharded keys"):
        RedisTransport(connect_sync(redis_cluster.url), worker_id=WORKER_ID, keys=Keys("plain"))


def test_handed_back_and_orphaned_requests_of_every_shard_are_taken_again(
    redis_cluster: ClusterGroup, client: redis.cluster.RedisCluster, keys: Keys, transport: RedisTransport
) -> None:
    messages = [request(f"moved-{i}") for i in range(12)]
    transport.receive(0, block_ms=0)
    submit(redis_cluster.url, keys, messages)
    taken = take_all(transport, 12, max_new=12)
    transport.begin([StartedRequest(m.request_id, 11, 0) for m in taken])
    transport.publish([TokenEvent(m.request_id, 0, 0, [4], WORKER_ID) for m in taken], [])
    handed, kept = taken[:6], taken[6:]
    transport.hand_back([m.request_id for m in handed])

    assert sum(client.zcard(keys.running_index(shard)) for shard in range(keys.shards)) == len(kept)
    heir = RedisTransport(
        connect_sync(redis_cluster.url), worker_id="heir", keys=keys, heartbeat_ttl_s=30, reclaim_idle_ms=0
    )
    received: list[Redelivery] = []
    deadline = time.monotonic() + 10
    while len(received) < len(taken) and time.monotonic() < deadline:  # the taker has no heartbeat: lost
        received += [item for item in heir.receive(12, block_ms=20) if isinstance(item, Redelivery)]
        time.sleep(0.05)

    assert sorted(r.request_id for r in received) == sorted(m.request_id for m in taken)
    for item in received:
        assert item.record is not None and item.record.seed == 11 and item.record.next_seq == 1
    assert {r.request_id: r.deliveries for r in received} == {
        **{m.request_id: 1 for m in handed},  # queued again as new entries
        **{m.request_id: 2 for m in kept},  # claimed from the lost worker
    }


def test_an_entry_that_does_not_decode_is_set_aside_in_its_own_shard(
    client: redis.cluster.RedisCluster, keys: Keys, transport: RedisTransport
) -> None:
    transport.receive(0, block_ms=0)
    stream = keys.request_stream(Priority.INTERACTIVE, 3)
    client.xadd(stream, {"msg": b"\xc1 not msgpack"})

    received: list[object] = []
    deadline = time.monotonic() + 10
    while not received and time.monotonic() < deadline:
        received = list(transport.receive(4, block_ms=20))

    assert [type(item).__name__ for item in received] == ["DeadLetter"]
    assert client.xlen(stream) == 0 and client.xlen(keys.dead_letter(3)) == 1
