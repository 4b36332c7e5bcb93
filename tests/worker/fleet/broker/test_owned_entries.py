"""A worker lets go of a stream entry (ack, delete, dead-letter, re-queue) only while it still owns it:
a lapsed worker that finishes a request its heir claimed leaves the heir's entry pending, so a third
worker can still reclaim it when the heir dies too. On a real Redis and on fakeredis (with Lua)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import fakeredis
import pytest
import redis

from metrale.shared.codec import encode
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import FinishReason, GenerateRequest, Priority
from metrale.worker.fleet.broker.redis_transport import RedisTransport, redis_client
from metrale.worker.fleet.transport import FinishedRequest


@pytest.fixture(params=[pytest.param("redis-server", marks=pytest.mark.redis), "fakeredis"])
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    if request.param == "fakeredis":
        client: redis.Redis = fakeredis.FakeRedis()
    else:
        client = redis_client(request.getfixturevalue("real_redis_url"))
    yield client
    client.close()


def transport(client: redis.Redis, keys: Keys, worker_id: str) -> RedisTransport:
    return RedisTransport(client, worker_id=worker_id, keys=keys, heartbeat_ttl_s=5, reclaim_idle_ms=0)


def enqueue(client: redis.Redis, keys: Keys, request_id: str) -> str:
    request = GenerateRequest(request_id, "tiny", "default", [1, 2, 3], max_tokens=4)
    return cast(bytes, client.xadd(keys.request_stream(Priority.INTERACTIVE), {"msg": encode(request)})).decode()


def owner(client: redis.Redis, keys: Keys, entry_id: str) -> str | None:
    """The consumer the entry is pending for (None: not pending)."""
    stream = keys.request_stream(Priority.INTERACTIVE)
    pending = cast(list[dict[str, Any]], client.xpending_range(stream, WORKER_GROUP, entry_id, entry_id, 1))
    return pending[0]["consumer"].decode() if pending else None


def claimed_from_a(client: redis.Redis, keys: Keys) -> tuple[RedisTransport, RedisTransport, str]:
    """worker-a takes cmpl-1, lapses, and worker-b (its heir) claims the entry: (a, b, the entry id)."""
    lapsed, heir = transport(client, keys, "worker-a"), transport(client, keys, "worker-b")
    entry_id = enqueue(client, keys, "cmpl-1")
    assert len(lapsed.receive(1, 0)) == 1  # worker-a has no heartbeat key: lost, to the others
    assert len(heir.receive(1, 0)) == 1
    assert owner(client, keys, entry_id) == "worker-b"
    return lapsed, heir, entry_id


def test_a_lapsed_worker_finishing_leaves_its_heirs_entry_for_a_third_to_reclaim(
    client: redis.Redis, keys: Keys
) -> None:
    lapsed, _, entry_id = claimed_from_a(client, keys)

    lapsed.publish([], [FinishedRequest("cmpl-1", FinishReason.LENGTH)])

    assert owner(client, keys, entry_id) == "worker-b"
    assert client.xlen(keys.request_stream(Priority.INTERACTIVE)) == 1
    # worker-b dies (it never beat): worker-c takes the request over.
    (taken,) = transport(client, keys, "worker-c").receive(1, 0)
    assert owner(client, keys, entry_id) == "worker-c"
    assert cast(Any, taken).request.request_id == "cmpl-1"


def test_the_owner_finishing_acks_and_deletes_its_entry(client: redis.Redis, keys: Keys) -> None:
    _, heir, entry_id = claimed_from_a(client, keys)

    heir.publish([], [FinishedRequest("cmpl-1", FinishReason.LENGTH)])

    assert owner(client, keys, entry_id) is None
    assert client.xlen(keys.request_stream(Priority.INTERACTIVE)) == 0


def test_a_lapsed_worker_does_not_dead_letter_its_heirs_entry(client: redis.Redis, keys: Keys) -> None:
    lapsed, _, entry_id = claimed_from_a(client, keys)

    lapsed.publish([], [FinishedRequest("cmpl-1", FinishReason.ERROR, "lost", dead_letter="kept losing workers")])

    assert client.xlen(keys.dead_letter()) == 0
    assert owner(client, keys, entry_id) == "worker-b"


def test_a_lapsed_worker_hands_back_only_its_own_entries(client: redis.Redis, keys: Keys) -> None:
    lapsed, _, entry_id = claimed_from_a(client, keys)
    own_id = enqueue(client, keys, "cmpl-2")
    assert len(lapsed.receive(1, 0)) == 1

    lapsed.hand_back(["cmpl-1", "cmpl-2"])

    stream = keys.request_stream(Priority.INTERACTIVE)
    remaining = [entry.decode() for entry, _ in cast(list[Any], client.xrange(stream))]
    assert entry_id in remaining and own_id not in remaining and len(remaining) == 2  # cmpl-2 queued anew
    assert owner(client, keys, entry_id) == "worker-b"


def test_the_owner_dead_letters_its_entry(client: redis.Redis, keys: Keys) -> None:
    _, heir, entry_id = claimed_from_a(client, keys)

    heir.publish([], [FinishedRequest("cmpl-1", FinishReason.ERROR, "lost", dead_letter="kept losing workers")])

    assert client.xlen(keys.dead_letter()) == 1
    assert owner(client, keys, entry_id) is None
    assert client.xlen(keys.request_stream(Priority.INTERACTIVE)) == 0
