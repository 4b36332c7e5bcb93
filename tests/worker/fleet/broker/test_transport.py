"""The worker's transports: the Redis side of the fleet protocol (on fakeredis) and the in-memory twin."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator

import fakeredis
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry

from metrale.shared.codec import decode, encode
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import (
    CancelRequest,
    FinishReason,
    GenerateRequest,
    ModelAnnouncement,
    Priority,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
)
from metrale.shared.record import RECORD_REFRESH_S, RunStatus, read_record
from metrale.worker.fleet.broker import redis_transport
from metrale.worker.fleet.broker.redis_transport import RedisTransport
from metrale.worker.fleet.broker.resp import SentTransaction, Transaction, send_transaction
from metrale.worker.fleet.transport import (
    DUPLICATE_REASON,
    DeadLetter,
    FinishedRequest,
    InMemoryTransport,
    TransportError,
    parse_entry,
)

WORKER_ID = "worker-a"
HEARTBEAT_TTL_S = 7


def generate_request(request_id: str, priority: Priority = Priority.INTERACTIVE) -> GenerateRequest:
    return GenerateRequest(request_id, "tiny", "default", [1, 2, 3], max_tokens=4, priority=priority)


def heartbeat() -> WorkerHeartbeat:
    return WorkerHeartbeat(WORKER_ID, "tiny", 1, 0, 0, 1, 12.5, 3, 40, started_at=1.0, sent_at=2.0)


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    client = fakeredis.FakeRedis()
    yield client
    client.close()


@pytest.fixture
def transport(client: redis.Redis, keys: Keys) -> RedisTransport:
    return RedisTransport(client, worker_id=WORKER_ID, keys=keys, heartbeat_ttl_s=HEARTBEAT_TTL_S)


def enqueue(client: redis.Redis, keys: Keys, payload: GenerateRequest | bytes, priority: Priority) -> str:
    raw = encode(payload) if isinstance(payload, GenerateRequest) else payload
    entry_id = client.xadd(keys.request_stream(priority), {"msg": raw})
    return entry_id.decode()


def pending(client: redis.Redis, keys: Keys, priority: Priority) -> int:
    return int(client.xpending(keys.request_stream(priority), WORKER_GROUP)["pending"])


# --- parse_entry -------------------------------------------------------------------------------

BAD_ENTRIES = {
    "no-msg-field": (None, "no 'msg' field"),
    "garbage-bytes": (b"\xc1 not msgpack", "not a msgpack payload"),
    "wrong-kind": (encode(CancelRequest("chatcmpl-1", "client gone")), "expected a 'generate' message"),
    "bad-request-id": (encode(generate_request("chat:cmpl 1")), "invalid request id"),
}


@pytest.mark.parametrize(("raw", "reason"), BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_parse_entry_explains_what_cannot_be_served(raw: bytes | None, reason: str) -> None:
    parsed = parse_entry(raw)
    assert isinstance(parsed, str)
    assert reason in parsed


def test_parse_entry_returns_the_request() -> None:
    request = generate_request("chatcmpl-1")
    assert parse_entry(encode(request)) == request


# --- RedisTransport: taking requests --------------------------------------------------------------


def test_receive_takes_interactive_before_batch_and_never_more_than_asked(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    for i in range(2):
        enqueue(client, keys, generate_request(f"batch-{i}", Priority.BATCH), Priority.BATCH)
    for i in range(3):
        enqueue(client, keys, generate_request(f"inter-{i}"), Priority.INTERACTIVE)

    assert transport.receive(0, block_ms=0) == []
    first = transport.receive(2, block_ms=0)
    second = transport.receive(5, block_ms=0)

    assert [r.request_id for r in first if isinstance(r, GenerateRequest)] == ["inter-0", "inter-1"]
    assert [r.request_id for r in second if isinstance(r, GenerateRequest)] == ["inter-2", "batch-0", "batch-1"]
    assert (pending(client, keys, Priority.INTERACTIVE), pending(client, keys, Priority.BATCH)) == (3, 2)


def test_receive_reads_as_this_worker_and_marks_requests_running(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    enqueue(client, keys, generate_request("chatcmpl-1"), Priority.INTERACTIVE)

    assert len(transport.receive(4, block_ms=0)) == 1

    consumers = client.xinfo_consumers(keys.request_stream(Priority.INTERACTIVE), WORKER_GROUP)
    assert [(c["name"], c["pending"]) for c in consumers] == [(WORKER_ID.encode(), 1)]
    record = read_record(client, "chatcmpl-1", keys=keys)
    assert record is not None
    assert (record.status, record.worker_id) == (RunStatus.RUNNING, WORKER_ID)


def test_receive_blocks_briefly_when_asked_and_nothing_is_queued(transport: RedisTransport) -> None:
    started = time.monotonic()
    assert transport.receive(4, block_ms=100) == []
    assert time.monotonic() - started >= 0.09


def test_a_garbage_entry_is_dead_lettered_and_the_next_one_still_served(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    garbage_id = enqueue(client, keys, b"\x00garbage", Priority.INTERACTIVE)
    enqueue(client, keys, generate_request("chatcmpl-ok"), Priority.INTERACTIVE)

    dead, served = transport.receive(4, block_ms=0)

    assert isinstance(dead, DeadLetter) and isinstance(served, GenerateRequest)
    assert served.request_id == "chatcmpl-ok"
    ((_, fields),) = client.xrange(keys.dead_letter())
    stream = keys.request_stream(Priority.INTERACTIVE)
    assert fields[b"stream"] == stream.encode() and fields[b"entry_id"] == garbage_id.encode()
    assert fields[b"raw"] == b"\x00garbage" and fields[b"reason"] == dead.reason.encode()
    assert garbage_id.encode() not in [entry_id for entry_id, _ in client.xrange(stream)]
    assert pending(client, keys, Priority.INTERACTIVE) == 1  # only the served request


def test_a_request_id_already_running_here_is_dead_lettered(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    enqueue(client, keys, generate_request("chatcmpl-1"), Priority.INTERACTIVE)
    transport.receive(4, block_ms=0)
    enqueue(client, keys, generate_request("chatcmpl-1"), Priority.INTERACTIVE)

    (dead,) = transport.receive(4, block_ms=0)

    assert isinstance(dead, DeadLetter) and dead.reason == DUPLICATE_REASON
    assert client.xlen(keys.dead_letter()) == 1


def test_a_vanished_consumer_group_is_recreated(transport: RedisTransport, client: redis.Redis, keys: Keys) -> None:
    transport.receive(4, block_ms=0)
    client.xgroup_destroy(keys.request_stream(Priority.INTERACTIVE), WORKER_GROUP)  # as in a fresh Redis

    assert transport.receive(4, block_ms=0) == []
    enqueue(client, keys, generate_request("chatcmpl-1"), Priority.INTERACTIVE)
    assert [r.request_id for r in transport.receive(4, block_ms=0) if isinstance(r, GenerateRequest)] == ["chatcmpl-1"]


# --- RedisTransport: publishing -----------------------------------------------------------------


def token_event(seq: int, token: int, *, final: FinishReason | None = None, error: str | None = None) -> TokenEvent:
    usage = Usage(3, seq + 1, 0) if final is not None else None
    return TokenEvent("chatcmpl-1", 0, seq, [token], WORKER_ID, finished=final is not None, finish_reason=final,
                      error=error, usage=usage)  # fmt: skip


def test_publish_writes_events_record_status_and_ack_in_one_transaction(
    transport: RedisTransport, client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue(client, keys, generate_request("chatcmpl-1"), Priority.INTERACTIVE)
    transport.receive(1, block_ms=0)
    listener = client.pubsub()
    listener.subscribe(keys.token_channel("chatcmpl-1"))
    sent: list[int] = []  # commands per transaction

    def recording_send(target: redis.Redis, transaction: Transaction) -> SentTransaction:
        sent.append(transaction.count)
        return send_transaction(target, transaction)

    monkeypatch.setattr(redis_transport, "send_transaction", recording_send)
    events = [token_event(0, 7), token_event(1, 9, final=FinishReason.LENGTH)]

    transport.publish(events, [FinishedRequest("chatcmpl-1", FinishReason.LENGTH)])

    assert len(sent) == 1 and sent[0] > len(events)  # a PUBLISH each, the appends, the status, the XACK...
    published = [
        decode(m["data"]) for m in iter(lambda: listener.get_message(timeout=0.1), None) if m["type"] == "message"
    ]
    assert published == events
    record = read_record(client, "chatcmpl-1", keys=keys)
    assert record is not None
    assert record.events == tuple(events)
    assert (record.status, record.finish_reason, record.worker_id) == (
        RunStatus.FINISHED,
        FinishReason.LENGTH,
        WORKER_ID,
    )
    assert pending(client, keys, Priority.INTERACTIVE) == 0
    assert client.xlen(keys.request_stream(Priority.INTERACTIVE)) == 0


def test_a_request_without_live_events_publishes_only_its_first_and_final_events(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    enqueue(client, keys, dataclasses.replace(generate_request("chatcmpl-1"), live_events=False), Priority.INTERACTIVE)
    transport.receive(1, block_ms=0)
    listener = client.pubsub()
    listener.subscribe(keys.token_channel("chatcmpl-1"))
    events = [token_event(0, 7), token_event(1, 8), token_event(2, 9), token_event(3, 5, final=FinishReason.LENGTH)]

    transport.publish(events[:2], [])
    transport.publish(events[2:], [FinishedRequest("chatcmpl-1", FinishReason.LENGTH)])

    published = [
        decode(m["data"]) for m in iter(lambda: listener.get_message(timeout=0.1), None) if m["type"] == "message"
    ]
    assert published == [events[0], events[3]]
    record = read_record(client, "chatcmpl-1", keys=keys)
    assert record is not None and record.events == tuple(events)  # the reader takes the rest from here


def test_a_records_worker_and_ttl_are_refreshed_on_its_first_events_then_every_refresh_interval(
    transport: RedisTransport, client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue(client, keys, generate_request("chatcmpl-1"), Priority.INTERACTIVE)
    transport.receive(1, block_ms=0)
    now = [1000.0]
    monkeypatch.setattr(redis_transport.time, "monotonic", lambda: now[0])
    events_key, record_key = keys.run_events("chatcmpl-1"), keys.run_record("chatcmpl-1")

    transport.publish([token_event(0, 7)], [])
    assert client.ttl(events_key) > RECORD_REFRESH_S and client.ttl(record_key) > RECORD_REFRESH_S
    client.expire(events_key, 30)  # a TTL no later append within the interval touches
    now[0] += RECORD_REFRESH_S / 2
    transport.publish([token_event(1, 8), token_event(2, 9)], [])
    assert 0 < client.ttl(events_key) <= 30
    now[0] += RECORD_REFRESH_S / 2
    transport.publish([token_event(3, 5)], [])
    assert client.ttl(events_key) > RECORD_REFRESH_S

    record = read_record(client, "chatcmpl-1", keys=keys)
    assert record is not None and record.is_contiguous and record.token_ids() == [7, 8, 9, 5]
    assert record.worker_id == WORKER_ID


def test_publish_records_the_error_of_a_refused_request(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    event = token_event(0, 7, final=FinishReason.ERROR, error="prompt too long")

    transport.publish([event], [FinishedRequest("chatcmpl-1", FinishReason.ERROR, "prompt too long")])

    record = read_record(client, "chatcmpl-1", keys=keys)
    assert record is not None
    assert (record.finish_reason, record.error) == (FinishReason.ERROR, "prompt too long")


# --- RedisTransport: cancellations, liveness ---------------------------------------------------


def test_cancellations_are_collected_from_the_cancel_channel(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    assert transport.cancellations() == []  # subscribes
    client.publish(keys.cancel_channel(), encode(CancelRequest("chatcmpl-1", "client disconnected")))
    client.publish(keys.cancel_channel(), b"not a cancel message")
    client.publish(keys.cancel_channel(), encode(CancelRequest("chatcmpl-2", "stop string")))

    assert transport.cancellations() == ["chatcmpl-1", "chatcmpl-2"]
    assert transport.cancellations() == []


def test_a_busy_worker_reads_requests_and_cancels_at_most_once_per_poll_interval(
    client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(redis_transport.time, "monotonic", lambda: now[0])
    transport = RedisTransport(client, worker_id=WORKER_ID, keys=keys, poll_every_s=0.005)
    assert transport.receive(4, block_ms=0) == []  # found nothing: the next 5 ms read nothing
    assert transport.cancellations() == []
    enqueue(client, keys, generate_request("chatcmpl-1"), Priority.INTERACTIVE)
    client.publish(keys.cancel_channel(), encode(CancelRequest("chatcmpl-9", "client disconnected")))

    now[0] += 0.004
    assert transport.receive(4, block_ms=0) == []
    assert transport.cancellations() == []
    assert [r.request_id for r in transport.receive(4, block_ms=10)] == ["chatcmpl-1"]  # a blocking read: always

    now[0] += 0.002
    assert transport.cancellations() == ["chatcmpl-9"]
    enqueue(client, keys, generate_request("chatcmpl-2"), Priority.INTERACTIVE)
    received = transport.receive(4, block_ms=0)  # the last read found something: read again at once
    assert [r.request_id for r in received] == ["chatcmpl-2"]


def test_heartbeat_is_written_with_its_ttl_and_withdrawn_on_close(
    transport: RedisTransport, client: redis.Redis, keys: Keys
) -> None:
    transport.heartbeat(heartbeat())

    key = keys.worker(WORKER_ID)
    assert decode(client.hget(key, "msg")) == heartbeat()
    assert 0 < client.ttl(key) <= HEARTBEAT_TTL_S
    transport.close()
    assert not client.exists(key)


def test_announce_writes_the_model_hash(transport: RedisTransport, client: redis.Redis, keys: Keys) -> None:
    model = ModelAnnouncement("tiny", "{}", "{}", 128, 32, [3], "ab" * 32)

    transport.announce(model)

    assert decode(client.hget(keys.model("tiny"), "msg")) == model


def test_an_unreachable_redis_raises_transport_error(keys: Keys) -> None:
    unreachable = redis.Redis(port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))  # nothing on port 1
    transport = RedisTransport(unreachable, worker_id=WORKER_ID, keys=keys)

    with pytest.raises(TransportError):
        transport.receive(1, block_ms=0)
    with pytest.raises(TransportError):
        transport.publish([token_event(0, 7)], [])


# --- InMemoryTransport ----------------------------------------------------------------------------


def test_in_memory_transport_orders_limits_and_dead_letters_like_redis() -> None:
    transport = InMemoryTransport()
    transport.submit(generate_request("batch-0", Priority.BATCH))
    transport.submit_raw(b"garbage")
    transport.submit(generate_request("inter-0"))

    taken = transport.receive(2, block_ms=0)

    assert isinstance(taken[0], DeadLetter) and taken[0].raw == b"garbage"
    assert isinstance(taken[1], GenerateRequest) and taken[1].request_id == "inter-0"
    assert transport.queued(Priority.BATCH) == 1
    transport.submit(generate_request("inter-0"))
    (duplicate,) = transport.receive(1, block_ms=0)
    assert isinstance(duplicate, DeadLetter) and duplicate.reason == DUPLICATE_REASON


def test_in_memory_receive_wakes_when_a_request_arrives() -> None:
    transport = InMemoryTransport()
    timer = threading.Timer(0.05, transport.submit, [generate_request("chatcmpl-1")])
    timer.start()

    taken = transport.receive(1, block_ms=5000)

    timer.join()
    assert [r.request_id for r in taken if isinstance(r, GenerateRequest)] == ["chatcmpl-1"]


def test_a_vanished_model_announcement_is_written_again_with_the_next_heartbeat() -> None:
    import fakeredis

    from metrale.shared.codec import decode
    from metrale.shared.keys import Keys
    from metrale.shared.messages import WorkerHeartbeat
    from metrale.worker.fleet.broker.redis_transport import RedisTransport
    from tests.worker.worker_helpers import announcement

    client = fakeredis.FakeRedis()
    keys = Keys("met-test-announce")
    transport = RedisTransport(client, worker_id="w1", keys=keys, heartbeat_ttl_s=5)
    transport.announce(announcement())
    client.flushdb()
    transport.heartbeat(WorkerHeartbeat("w1", announcement().model, 0, 0, 0, 0, 0.0, 4, 64, 0.0, 0.0))
    assert decode(client.hget(keys.model(announcement().model), "msg")) == announcement()


@settings(max_examples=150, deadline=None)
@given(
    entries=st.lists(
        st.dictionaries(
            st.binary(min_size=1, max_size=8) | st.just(b"msg"), st.binary(max_size=96), min_size=1, max_size=3
        ),
        min_size=1,
        max_size=5,
    )
)
def test_arbitrary_stream_entries_are_dead_lettered_and_never_crash_the_worker(
    entries: list[dict[bytes, bytes]],
) -> None:
    client = fakeredis.FakeRedis()
    keys = Keys(f"met-test-{uuid.uuid4().hex}")
    transport = RedisTransport(client, worker_id=WORKER_ID, keys=keys, heartbeat_ttl_s=HEARTBEAT_TTL_S)
    stream = keys.request_stream(Priority.INTERACTIVE)
    transport.receive(1, block_ms=0)  # creates the consumer group
    for fields in entries:
        client.xadd(stream, fields)  # type: ignore[arg-type]
    enqueue(client, keys, generate_request("chatcmpl-ok"), Priority.INTERACTIVE)

    received = transport.receive(len(entries) + 1, block_ms=0)

    served = [item for item in received if isinstance(item, GenerateRequest)]
    dead = [item for item in received if isinstance(item, DeadLetter)]
    assert "chatcmpl-ok" in [request.request_id for request in served]
    assert len(dead) == len(client.xrange(keys.dead_letter())) == len(received) - len(served)
    assert all(fields[b"reason"] for _, fields in client.xrange(keys.dead_letter()))
    client.close()
