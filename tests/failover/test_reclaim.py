"""The Redis side of failover (on fakeredis): requests of lost workers are taken over, requests are
handed back and dead-lettered, and whoever takes a request again gets its record."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import fakeredis
import pytest
import redis

from metrale.shared.codec import decode, encode
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import (
    FinishReason,
    GenerateRequest,
    ModelAnnouncement,
    Priority,
    TokenEvent,
    WorkerHeartbeat,
)
from metrale.shared.record import RunStatus, read_record
from metrale.worker.fleet.broker.redis_transport import RedisTransport
from metrale.worker.fleet.transport import FinishedRequest, Received, Redelivery, StartedRequest

IDLE_MS = 60
STREAM_PRIORITY = Priority.INTERACTIVE


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def client(server: fakeredis.FakeServer) -> Iterator[redis.Redis]:
    client = fakeredis.FakeRedis(server=server)
    yield client
    client.close()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"met-test-{uuid.uuid4().hex}")


def transport(server: fakeredis.FakeServer, keys: Keys, worker_id: str) -> RedisTransport:
    client = fakeredis.FakeRedis(server=server)
    return RedisTransport(client, worker_id=worker_id, keys=keys, heartbeat_ttl_s=1, reclaim_idle_ms=IDLE_MS)


def request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, "tiny", "default", [1, 2, 3], max_tokens=8, created_at=1.0)


def beat(worker: RedisTransport, worker_id: str) -> None:
    worker.heartbeat(WorkerHeartbeat(worker_id, "tiny", 1, 0, 0, 1, 1.0, 3, 40, started_at=1.0, sent_at=2.0))


def taken_by_ghost(client: redis.Redis, keys: Keys, message: GenerateRequest, ghost: str) -> None:
    """Queue ``message`` and take it as consumer ``ghost``, a worker that never beats (it died)."""
    stream = keys.request_stream(STREAM_PRIORITY)
    with contextlib.suppress(redis.ResponseError):  # the group exists already
        client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
    client.xadd(stream, {"msg": encode(message)})
    client.xreadgroup(WORKER_GROUP, ghost, {stream: ">"})


def redeliveries(received: list[Received]) -> list[Redelivery]:
    assert all(isinstance(item, Redelivery) for item in received), received
    return [item for item in received if isinstance(item, Redelivery)]


def test_a_lost_workers_request_is_taken_over_with_its_record(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    taken_by_ghost(client, keys, request("r1"), "ghost")
    dead = transport(server, keys, "ghost")
    dead.begin([StartedRequest("r1", seed=4242, cached_tokens=2)])
    event = TokenEvent("r1", 0, 0, [9], "ghost")
    dead.publish([event], [])
    time.sleep(IDLE_MS / 1000 * 1.5)

    (item,) = redeliveries(transport(server, keys, "heir").receive(4, block_ms=0))

    assert item.request == request("r1") and item.deliveries == 2
    assert item.record is not None
    assert (item.record.seed, item.record.cached_tokens, item.record.events) == (4242, 2, (event,))
    consumers = client.xinfo_consumers(keys.request_stream(STREAM_PRIORITY), WORKER_GROUP)
    assert {c["name"]: c["pending"] for c in consumers} == {b"ghost": 0, b"heir": 1}


def test_a_live_workers_request_stays_with_it_however_long_it_runs(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    taken_by_ghost(client, keys, request("r1"), "alive")
    beat(transport(server, keys, "alive"), "alive")
    time.sleep(IDLE_MS / 1000 * 1.5)

    assert transport(server, keys, "other").receive(4, block_ms=0) == []


def test_a_request_just_taken_is_not_taken_over_before_its_worker_first_beats(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    taken_by_ghost(client, keys, request("r1"), "starting")

    assert transport(server, keys, "other").receive(4, block_ms=0) == []


def test_of_two_workers_taking_over_one_request_only_one_gets_it(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    taken_by_ghost(client, keys, request("r1"), "ghost")
    time.sleep(IDLE_MS / 1000 * 1.5)

    first = transport(server, keys, "heir-1").receive(4, block_ms=0)
    second = transport(server, keys, "heir-2").receive(4, block_ms=0)

    assert [item.request_id for item in redeliveries(first)] == ["r1"]
    assert second == []


def test_entries_held_under_this_workers_name_by_an_earlier_process_are_taken_over(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    taken_by_ghost(client, keys, request("r1"), "fixed-name")
    time.sleep(IDLE_MS / 1000 * 1.5)
    restarted = transport(server, keys, "fixed-name")
    beat(restarted, "fixed-name")

    (item,) = redeliveries(restarted.receive(4, block_ms=0))

    assert item.request_id == "r1" and item.deliveries == 2


def test_a_handed_back_request_is_queued_again_and_the_next_worker_gets_its_record(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    stopping = transport(server, keys, "stopping")
    client.xadd(keys.request_stream(STREAM_PRIORITY), {"msg": encode(request("r2"))})
    (taken,) = stopping.receive(4, block_ms=0)
    assert isinstance(taken, GenerateRequest) and taken.request_id == "r2"
    stopping.begin([StartedRequest("r2", seed=7, cached_tokens=0)])
    stopping.publish([TokenEvent("r2", 0, 0, [5], "stopping")], [])

    stopping.hand_back(["r2"])

    record = read_record(client, "r2", keys=keys)
    assert record is not None and record.status is RunStatus.QUEUED
    stream = keys.request_stream(STREAM_PRIORITY)
    assert client.xpending(stream, WORKER_GROUP)["pending"] == 0
    assert [decode(fields[b"msg"]) for _, fields in client.xrange(stream)] == [request("r2")]
    (item,) = redeliveries(transport(server, keys, "next").receive(4, block_ms=0))
    assert item.deliveries == 1 and item.record is not None
    assert (item.record.seed, item.record.next_seq) == (7, 1)


def test_a_finished_request_can_be_dead_lettered_with_its_error(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    worker = transport(server, keys, "w")
    client.xadd(keys.request_stream(STREAM_PRIORITY), {"msg": encode(request("poison"))})
    worker.receive(4, block_ms=0)
    reason = "lost too many workers"
    final = TokenEvent("poison", 0, 0, [], "w", finished=True, finish_reason=FinishReason.ERROR, error=reason)

    worker.publish([final], [FinishedRequest("poison", FinishReason.ERROR, reason, dead_letter=reason)])

    ((_, fields),) = client.xrange(keys.dead_letter())
    assert fields[b"reason"] == reason.encode() and decode(fields[b"raw"]) == request("poison")
    stream = keys.request_stream(STREAM_PRIORITY)
    assert client.xpending(stream, WORKER_GROUP)["pending"] == 0
    record = read_record(client, "poison", keys=keys)
    assert record is not None and (record.finish_reason, record.error) == (FinishReason.ERROR, reason)


@pytest.mark.redis
def test_after_redis_restarts_empty_the_worker_writes_its_announcement_and_records_again(
    real_redis_url: str, keys: Keys
) -> None:
    client = redis.Redis.from_url(real_redis_url)
    worker = RedisTransport(redis.Redis.from_url(real_redis_url), worker_id="w", keys=keys)
    model = ModelAnnouncement("tiny", "{}", "{}", 128, 32, [3], "ab" * 32)
    worker.announce(model)
    client.xadd(keys.request_stream(STREAM_PRIORITY), {"msg": encode(request("r1"))})
    worker.receive(4, block_ms=0)
    worker.begin([StartedRequest("r1", seed=4242, cached_tokens=0)])

    client.delete(*client.scan_iter(match=f"{keys.namespace}:*"))  # what a restart without persistence does
    assert worker.receive(4, block_ms=0) == []  # finds the groups gone
    worker.receive(4, block_ms=0)  # makes them again, and sees what Redis lost

    assert decode(client.hget(keys.model("tiny"), "msg")) == model
    record = read_record(client, "r1", keys=keys)
    assert record is not None and (record.status, record.worker_id, record.seed) == (RunStatus.RUNNING, "w", 4242)
    client.delete(*client.scan_iter(match=f"{keys.namespace}:*"))
    worker.close()
    client.close()
