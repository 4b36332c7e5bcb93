"""``RedisTransport`` with replicas to wait for: a write the primary answering after a failover lacks
is written again, one it holds is not; the worker's own entry delivered again after a failover is not a
duplicate."""

from __future__ import annotations

from collections.abc import Iterator

import fakeredis
import pytest
import redis

from metrale.shared.codec import encode
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import FinishReason, GenerateRequest, Priority, TokenEvent, Usage
from metrale.shared.record import RunStatus, read_record
from metrale.shared.replication import Replication
from metrale.worker.fleet.broker.redis_transport import RedisTransport
from metrale.worker.fleet.transport import FinishedRequest, TransportError

WORKER_ID = "worker-1"
REQUEST = "chatcmpl-1"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    client = fakeredis.FakeRedis()
    yield client
    client.close()


def transport_of(client: redis.Redis, keys: Keys) -> RedisTransport:
    return RedisTransport(client, worker_id=WORKER_ID, keys=keys, replication=Replication(replicas=1, timeout_ms=10))


def take_one(client: redis.Redis, keys: Keys, transport: RedisTransport) -> None:
    request = GenerateRequest(REQUEST, "tiny", "default", [1, 2, 3], max_tokens=2)
    client.xadd(keys.request_stream(Priority.INTERACTIVE), {"msg": encode(request)})
    assert [r.request_id for r in transport.receive(1, block_ms=0) if isinstance(r, GenerateRequest)] == [REQUEST]


def events() -> list[TokenEvent]:
    final = {"finished": True, "finish_reason": FinishReason.LENGTH, "usage": Usage(3, 2, 0)}
    return [TokenEvent(REQUEST, 0, 0, [7], WORKER_ID), TokenEvent(REQUEST, 0, 1, [9], WORKER_ID, **final)]


def test_a_publish_the_promoted_primary_lacks_is_written_again(
    client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = transport_of(client, keys)
    monkeypatch.setattr(transport._waiter, "acknowledgements", lambda _: 0)  # no replica confirms the take
    take_one(client, keys, transport)

    def lose_the_newest_event(*_: object) -> int:  # as a primary that died before its replica had it
        client.rpop(keys.run_events(REQUEST))
        client.hset(keys.run_record(REQUEST), "status", RunStatus.RUNNING.value)
        return 0

    monkeypatch.setattr(transport._waiter, "acknowledgements", lose_the_newest_event)
    transport._waiter._paused_until = 0.0  # the take's shortfall paused the waits; a second later, it waits again
    transport.publish(events(), [FinishedRequest(REQUEST, FinishReason.LENGTH)])

    record = read_record(client, REQUEST, keys=keys)
    assert record is not None and record.events == tuple(events()) and record.status is RunStatus.FINISHED


def test_a_publish_the_primary_holds_is_not_written_twice(
    client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = transport_of(client, keys)
    monkeypatch.setattr(transport._waiter, "acknowledgements", lambda _: 0)  # a lone primary: nothing is lost
    take_one(client, keys, transport)
    transport._waiter._paused_until = 0.0

    transport.publish(events(), [FinishedRequest(REQUEST, FinishReason.LENGTH)])

    assert client.llen(keys.run_events(REQUEST)) == len(events())
    assert transport._waiter.shortfalls >= 1


def test_a_confirmed_publish_is_not_checked(client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    transport = transport_of(client, keys)
    monkeypatch.setattr(transport._waiter, "acknowledgements", lambda _: 1)
    take_one(client, keys, transport)
    monkeypatch.setattr(transport, "_lacks", lambda *_: pytest.fail("a confirmed write needs no check"))

    transport.publish(events(), [])

    assert transport._waiter.shortfalls == 0


def test_its_own_entry_delivered_again_after_a_failover_is_not_a_duplicate(client: redis.Redis, keys: Keys) -> None:
    transport = RedisTransport(client, worker_id=WORKER_ID, keys=keys)
    take_one(client, keys, transport)
    # A promoted replica that never heard of the take: the entry is undelivered there.
    client.xgroup_setid(keys.request_stream(Priority.INTERACTIVE), WORKER_GROUP, "0")

    assert transport.receive(1, block_ms=0) == []
    assert client.xlen(keys.dead_letter()) == 0
    transport.publish(events(), [FinishedRequest(REQUEST, FinishReason.LENGTH)])
    assert client.xlen(keys.request_stream(Priority.INTERACTIVE)) == 0  # acknowledged and deleted once finished


@pytest.mark.parametrize("lost", [False, True], ids=["held", "lost"])
def test_a_publish_repeated_after_its_confirmation_failed_is_written_once(
    client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch, lost: bool
) -> None:
    transport = transport_of(client, keys)
    monkeypatch.setattr(transport._waiter, "acknowledgements", lambda _: 1)
    take_one(client, keys, transport)

    def primary_dies(_: object) -> int:
        if lost:  # the promoted replica never had it
            client.delete(keys.run_events(REQUEST))
            client.hset(keys.run_record(REQUEST), "status", RunStatus.RUNNING.value)
        raise redis.ConnectionError("the primary died")

    monkeypatch.setattr(transport._waiter, "acknowledgements", primary_dies)
    with pytest.raises(TransportError):
        transport.publish(events(), [FinishedRequest(REQUEST, FinishReason.LENGTH)])
    monkeypatch.setattr(transport._waiter, "acknowledgements", lambda _: 1)
    transport.publish(events(), [FinishedRequest(REQUEST, FinishReason.LENGTH)])  # as the publisher repeats it

    assert client.llen(keys.run_events(REQUEST)) == len(events())
    record = read_record(client, REQUEST, keys=keys)
    assert record is not None and record.events == tuple(events()) and record.status is RunStatus.FINISHED
