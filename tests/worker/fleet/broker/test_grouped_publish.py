"""Grouped publishing: one ``TokenEventGroup`` per step and reply channel, the records unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import fakeredis
import pytest
import redis

from metrale.shared.codec import decode, encode
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, GenerateRequest, Priority, TokenEvent, TokenEventGroup, Usage
from metrale.shared.record import read_record
from metrale.worker.fleet.broker import redis_transport
from metrale.worker.fleet.broker.redis_transport import RedisTransport
from metrale.worker.fleet.broker.resp import SentTransaction, Transaction, send_transaction
from metrale.worker.fleet.transport import FinishedRequest, parse_entry

WORKER_ID = "worker-g"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    client = fakeredis.FakeRedis()
    yield client
    client.close()


@pytest.fixture
def transport(client: redis.Redis, keys: Keys) -> RedisTransport:
    return RedisTransport(client, worker_id=WORKER_ID, keys=keys)


def take(client: redis.Redis, keys: Keys, transport: RedisTransport, *requests: GenerateRequest) -> None:
    for request in requests:
        client.xadd(keys.request_stream(Priority.INTERACTIVE), {"msg": encode(request)})
    assert len(transport.receive(len(requests), block_ms=0)) == len(requests)


def request(request_id: str, reply_to: str | None, *, live: bool = True) -> GenerateRequest:
    return GenerateRequest(request_id, "tiny", "t", [1, 2], max_tokens=4, reply_to=reply_to, live_events=live)


def event(request_id: str, seq: int, *, final: bool = False) -> TokenEvent:
    reason, usage = (FinishReason.LENGTH, Usage(2, seq + 1, 0)) if final else (None, None)
    return TokenEvent(request_id, 0, seq, [10 + seq], WORKER_ID, finished=final, finish_reason=reason, usage=usage)


def heard(listener: redis.client.PubSub) -> list[tuple[str, object]]:
    """(channel, decoded message) of every message the listener holds."""
    messages = iter(lambda: listener.get_message(timeout=0.1), None)
    return [(m["channel"].decode(), decode(m["data"])) for m in messages if m["type"] == "message"]


def ungrouped(message: object) -> list[object]:
    assert isinstance(message, TokenEventGroup)
    return [decode(raw) for raw in message.events]


def test_one_step_sends_one_group_per_relay_and_its_own_channel_to_a_request_naming_none(
    transport: RedisTransport, client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    take(client, keys, transport, request("a", "relay-1"), request("b", "relay-1"), request("c", "relay-2"))
    take(client, keys, transport, request("d", None))
    listener = client.pubsub()
    listener.psubscribe(keys.reply_channel_pattern(), keys.token_channel_pattern())
    listener.get_message(timeout=0.1), listener.get_message(timeout=0.1)  # the two confirmations
    counts: list[int] = []

    def recording_send(target: redis.Redis, transaction: Transaction) -> SentTransaction:
        counts.append(transaction.count)
        return send_transaction(target, transaction)

    monkeypatch.setattr(redis_transport, "send_transaction", recording_send)
    step = [event("a", 0), event("b", 0), event("c", 0), event("d", 0), event("a", 1), event("b", 1, final=True)]

    transport.publish(step, [FinishedRequest("b", FinishReason.LENGTH)])

    messages = iter(lambda: listener.get_message(timeout=0.1), None)
    got = [(m["channel"].decode(), decode(m["data"])) for m in messages if m["type"] == "pmessage"]
    assert [channel for channel, _ in got] == [
        keys.token_channel("d"),
        keys.reply_channel("relay-1"),
        keys.reply_channel("relay-2"),
    ]
    assert got[0][1] == step[3]
    assert ungrouped(got[1][1]) == [step[0], step[1], step[4], step[5]]  # each request's in seq order
    assert ungrouped(got[2][1]) == [step[2]]
    # 3 PUBLISH, 4 RPUSH; the refreshes, finish and acknowledgement of the first events and "b" besides
    assert len(counts) == 1 and counts[0] > 7
    recorded = {"a": [step[0], step[4]], "b": [step[1], step[5]], "c": [step[2]], "d": [step[3]]}
    for request_id, events in recorded.items():
        record = read_record(client, request_id, keys=keys)
        assert record is not None and list(record.events) == events


def test_a_request_without_live_events_groups_only_its_first_and_final_events(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    take(client, keys, transport, request("q", "relay-1", live=False), request("l", "relay-1"))
    listener = client.pubsub()
    listener.subscribe(keys.reply_channel("relay-1"))
    events = [event("q", 0), event("q", 1), event("l", 0), event("q", 2, final=True)]

    transport.publish(events[:3], [])
    transport.publish(events[3:], [FinishedRequest("q", FinishReason.LENGTH)])

    got = heard(listener)
    assert [ungrouped(message) for _, message in got] == [[events[0], events[2]], [events[3]]]
    record = read_record(client, "q", keys=keys)
    assert record is not None and list(record.events) == [events[0], events[1], events[3]]


def test_a_step_with_only_quiet_events_of_a_relay_publishes_nothing_there(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    take(client, keys, transport, request("q", "relay-1", live=False))
    transport.publish([event("q", 0)], [])
    listener = client.pubsub()
    listener.subscribe(keys.reply_channel("relay-1"))

    transport.publish([event("q", 1)], [])

    assert heard(listener) == []
    record = read_record(client, "q", keys=keys)
    assert record is not None and [e.seq for e in record.events] == [0, 1]


@pytest.mark.parametrize("relay_id", ["a:b", "", "x y", "*"])
def test_an_entry_naming_a_relay_id_that_cannot_be_a_key_is_refused(relay_id: str) -> None:
    raw = encode(dataclasses.replace(request("r", None), reply_to=relay_id))
    reason = parse_entry(raw)
    assert isinstance(reason, str) and "reply_to relay id" in reason
