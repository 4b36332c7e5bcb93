"""A live worker whose heartbeat lapsed (starved, paused, cut off) learns at its next beat which of its
requests other workers took over, so it stops streaming them; on a real Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import GenerateRequest, Priority, WorkerHeartbeat
from metrale.worker.fleet.broker.redis_transport import RedisTransport, redis_client

pytestmark = pytest.mark.redis


@pytest.fixture
def client(real_redis_url: str) -> Iterator[redis.Redis]:
    client = redis_client(real_redis_url)
    yield client
    client.close()


def transport(client: redis.Redis, keys: Keys, worker_id: str) -> RedisTransport:
    return RedisTransport(client, worker_id=worker_id, keys=keys, heartbeat_ttl_s=5, reclaim_idle_ms=0)


def beat(worker: RedisTransport, worker_id: str) -> None:
    worker.heartbeat(WorkerHeartbeat(worker_id, "tiny", 1, 0, 0, 1, 1.0, 3, 40, started_at=1.0, sent_at=2.0))


def enqueue(client: redis.Redis, keys: Keys, request_id: str) -> None:
    request = GenerateRequest(request_id, "tiny", "default", [1, 2, 3], max_tokens=4)
    client.xadd(keys.request_stream(Priority.INTERACTIVE), {"msg": encode(request)})


def test_requests_taken_over_while_the_heartbeat_lapsed_are_named_once(client: redis.Redis, keys: Keys) -> None:
    starved, heir = transport(client, keys, "worker-a"), transport(client, keys, "worker-b")
    enqueue(client, keys, "cmpl-1")
    enqueue(client, keys, "cmpl-2")
    assert len(starved.receive(2, 0)) == 2
    beat(starved, "worker-a")
    client.delete(keys.worker("worker-a"))  # the TTL ran out while worker-a was starved

    (taken,) = heir.receive(1, 0)  # worker-b reclaims one of the two entries
    assert starved.taken_over() == []  # not known before worker-a's next beat
    beat(starved, "worker-a")

    assert starved.taken_over() == [taken.request_id]
    assert starved.taken_over() == []


def test_a_lapse_nobody_used_takes_nothing(client: redis.Redis, keys: Keys) -> None:
    worker = transport(client, keys, "worker-a")
    enqueue(client, keys, "cmpl-1")
    worker.receive(1, 0)
    beat(worker, "worker-a")
    client.delete(keys.worker("worker-a"))

    beat(worker, "worker-a")

    assert worker.taken_over() == []


def test_the_first_beat_and_an_emptied_redis_take_nothing(client: redis.Redis, keys: Keys) -> None:
    worker = transport(client, keys, "worker-a")
    enqueue(client, keys, "cmpl-1")
    worker.receive(1, 0)
    beat(worker, "worker-a")  # the first beat: no key before it, yet nothing lapsed
    assert worker.taken_over() == []
    for key in client.scan_iter(match=f"{keys.namespace}:*"):
        client.delete(key)  # Redis lost everything (restarted empty): streams and groups too

    beat(worker, "worker-a")

    assert worker.taken_over() == []
