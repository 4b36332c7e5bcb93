"""The publisher: batches written in the order submitted, each once, across failures; one write in
flight, its replies read at the next call; the barriers ``drain`` and ``close``. On an in-memory
transport whose writes complete only when waited for, and on the Redis one over fakeredis (records in
``seq`` order across an outage, a write whose replies were lost not written twice)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, GenerateRequest, Priority, TokenEvent
from metrale.shared.record import RunStatus, read_record
from metrale.worker.fleet.broker.redis_transport import RedisTransport
from metrale.worker.fleet.broker.resp import SentTransaction
from metrale.worker.fleet.outbox import Batch
from metrale.worker.fleet.publisher import Publisher
from metrale.worker.fleet.transport import FinishedRequest, InMemoryTransport, StartedRequest, TransportError

WAIT_S = 5.0


class PipelinedTransport(InMemoryTransport):
    """A write started by ``start_publish`` lands only when waited for; the next ``failures`` waits
    fail (or every one raises ``error`` when set). Logs every write call in ``calls``."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0
        self.error: Exception | None = None
        self.calls: list[str] = []

    def begin(self, started: Sequence[StartedRequest]) -> None:
        self.calls.append("begin")
        super().begin(started)

    def start_publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> Callable[[], None]:
        self.calls.append("sent")
        events, finished = list(events), list(finished)

        def wait() -> None:
            if self.error is not None:
                raise self.error
            if self.failures:
                self.failures -= 1
                self.calls.append("failed")
                raise TransportError("connection reset")
            self.calls.append("written")
            self.publish(events, finished)

        return wait

    def hand_back(self, request_ids: Sequence[str]) -> None:
        self.calls.append("hand_back")
        self.handed_back.extend(request_ids)


def events(request_id: str, *seqs: int) -> list[TokenEvent]:
    return [TokenEvent(request_id, 0, seq, [100 + seq], "w") for seq in seqs]


def batch(*seqs: int, request_id: str = "r") -> Batch:
    return Batch(events=events(request_id, *seqs))


def seqs_of(transport: InMemoryTransport, request_id: str = "r") -> list[int]:
    return [event.seq for event in transport.events if event.request_id == request_id]


@pytest.fixture
def transport() -> PipelinedTransport:
    return PipelinedTransport()


@pytest.fixture
def publisher(transport: PipelinedTransport) -> Publisher:
    return Publisher(transport)


# --- order ----------------------------------------------------------------------------------------


def test_batches_are_written_in_the_order_submitted_each_once(
    publisher: Publisher, transport: PipelinedTransport
) -> None:
    for step in range(30):
        publisher.submit(Batch(events=events("a", step) + events("b", 2 * step, 2 * step + 1)))
    publisher.submit(Batch())  # nothing to write: nothing queued

    assert publisher.drain()
    assert seqs_of(transport, "a") == list(range(30))
    assert seqs_of(transport, "b") == list(range(60))
    assert len(transport.publishes) == 30  # one publish per batch, never merged or split
    assert transport.calls == ["sent", "written"] * 30


def test_a_batch_writes_seeds_then_events_and_finishes_then_hand_backs(
    publisher: Publisher, transport: PipelinedTransport
) -> None:
    done = FinishedRequest("r", FinishReason.LENGTH)
    publisher.submit(Batch([StartedRequest("r", 7, 0)], events("r", 0, 1), [done], ["other"]))
    assert transport.calls == ["begin", "sent"]  # the hand-back waits for the events to be written

    assert publisher.drain()
    assert transport.calls == ["begin", "sent", "written", "hand_back"]
    assert transport.publishes == [(events("r", 0, 1), [done])]
    assert publisher.take_handed_back() == 1
    assert publisher.take_handed_back() == 0


# --- one write in flight ----------------------------------------------------------------------------


def test_a_batchs_write_is_waited_for_when_the_next_batch_comes(
    publisher: Publisher, transport: PipelinedTransport
) -> None:
    publisher.submit(batch(0))
    assert transport.calls == ["sent"] and publisher.unsent == 1  # the loop steps on meanwhile
    publisher.submit(Batch())  # a flush with nothing new leaves it in flight
    assert transport.calls == ["sent"] and publisher.unsent == 1
    publisher.submit(batch(1))
    assert transport.calls == ["sent", "written", "sent"]
    publisher.submit(batch(2))
    assert transport.calls == ["sent", "written", "sent", "written", "sent"]
    assert seqs_of(transport) == [0, 1] and publisher.unsent == 1
    assert publisher.drain() and seqs_of(transport) == [0, 1, 2] and publisher.unsent == 0


def test_a_batch_without_events_is_written_at_once(publisher: Publisher, transport: PipelinedTransport) -> None:
    publisher.submit(Batch([StartedRequest("r", 7, 0)], handbacks=["r"]))
    assert transport.calls == ["begin", "hand_back"] and publisher.unsent == 0
    assert publisher.take_handed_back() == 1


def test_a_publisher_never_given_a_batch_writes_nothing(transport: PipelinedTransport) -> None:
    publisher = Publisher(transport)
    publisher.submit(Batch())
    assert publisher.drain(0)
    assert publisher.close(0)
    assert transport.calls == []


# --- failures -------------------------------------------------------------------------------------


def test_a_failed_batch_stays_first_and_is_tried_again_at_the_next_call(
    publisher: Publisher, transport: PipelinedTransport
) -> None:
    transport.failures = 2
    publisher.submit(batch(0))
    with pytest.raises(TransportError, match="connection reset"):
        publisher.submit(batch(1))  # queued all the same, behind the failed one
    assert publisher.unsent == 2 and seqs_of(transport) == []

    with pytest.raises(TransportError):
        publisher.drain()  # batch 0 fails again
    assert publisher.drain()
    assert seqs_of(transport) == [0, 1]
    assert transport.calls == ["sent", "failed", "sent", "failed", "sent", "written", "sent", "written"]


def test_a_retried_batch_writes_only_what_it_had_not_written(
    publisher: Publisher, transport: PipelinedTransport
) -> None:
    transport.failures = 1
    publisher.submit(Batch([StartedRequest("r", 7, 0)], events("r", 0), [], ["r"]))
    with pytest.raises(TransportError):
        publisher.drain()
    assert publisher.drain()

    assert transport.calls == ["begin", "sent", "failed", "sent", "written", "hand_back"]
    assert seqs_of(transport) == [0]


def test_drain_with_a_timeout_tries_again_until_written(publisher: Publisher, transport: PipelinedTransport) -> None:
    transport.failures = 2
    publisher.submit(batch(0))
    assert publisher.drain(WAIT_S)
    assert seqs_of(transport) == [0] and transport.calls.count("failed") == 2


def test_close_gives_up_on_a_batch_that_keeps_failing(transport: PipelinedTransport) -> None:
    publisher = Publisher(transport)
    transport.failures = 1_000
    publisher.submit(batch(0))
    assert not publisher.close(0.3)
    assert publisher.unsent == 1 and seqs_of(transport) == []


def test_an_error_retrying_cannot_cure_reaches_the_loop(publisher: Publisher, transport: PipelinedTransport) -> None:
    transport.error = ValueError("WRONGTYPE")
    publisher.submit(batch(0))
    with pytest.raises(ValueError, match="WRONGTYPE"):
        publisher.drain(WAIT_S)  # not retried: only a TransportError is
    assert not publisher.close(0.1)


# --- over the Redis transport (fakeredis) -----------------------------------------------------------


def _taken_over_redis(server: fakeredis.FakeServer) -> tuple[redis.Redis, Keys, Publisher, Any]:
    """A client of ``server`` (no retries), a ``RedisTransport`` that took request ``r`` from its queue,
    a ``Publisher`` over it, and a pub/sub listener on ``r``'s token channel."""
    client: redis.Redis = fakeredis.FakeRedis(server=server, retry=Retry(NoBackoff(), 0))
    keys = Keys("met-test-publisher")
    request = GenerateRequest("r", "m", "t", [1, 2], max_tokens=8)
    client.xadd(keys.request_stream(Priority.INTERACTIVE), {"msg": encode(request)})
    transport = RedisTransport(client, worker_id="w", keys=keys)
    assert len(transport.receive(1, block_ms=0)) == 1
    listener = client.pubsub()
    listener.subscribe(keys.token_channel("r"))
    return client, keys, Publisher(transport), listener


def test_over_redis_a_requests_record_holds_its_events_in_seq_order_across_an_outage() -> None:
    server = fakeredis.FakeServer()
    client, keys, publisher, listener = _taken_over_redis(server)

    publisher.submit(Batch([StartedRequest("r", 7, 0)], events("r", 0, 1)))
    publisher.submit(batch(2, 3))
    assert publisher.drain(WAIT_S)
    server.connected = False  # Redis goes away
    with pytest.raises(TransportError):
        publisher.submit(batch(4, 5))
    with pytest.raises(TransportError):
        publisher.submit(batch(6))  # the loop steps on: queued behind the failed batch
    assert publisher.unsent == 2
    server.connected = True
    last = TokenEvent("r", 0, 7, [107], "w", finished=True, finish_reason=FinishReason.LENGTH)
    publisher.submit(Batch(events=[last], finished=[FinishedRequest("r", FinishReason.LENGTH)]))
    assert publisher.drain(WAIT_S)
    assert publisher.close(WAIT_S)

    record = read_record(client, "r", keys=keys)
    assert record is not None and record.is_contiguous
    assert [event.seq for event in record.events] == list(range(8))
    assert (record.status, record.seed) == (RunStatus.FINISHED, 7)
    heard = [m for m in iter(lambda: listener.get_message(timeout=0.05), None) if m["type"] == "message"]
    assert len(heard) == 8
    assert client.xlen(keys.request_stream(Priority.INTERACTIVE)) == 0  # acknowledged and deleted


def test_over_redis_a_write_whose_replies_were_lost_is_not_written_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sent, then the connection dropped before its replies were read: the write may have run, so the
    next try asks the primary first (it had: nothing is appended or published twice)."""
    client, keys, publisher, listener = _taken_over_redis(fakeredis.FakeServer())
    read = SentTransaction.replies

    def lost(self: SentTransaction) -> list[object]:
        read(self)  # the connection is given back; its replies never reach the caller
        raise redis.ConnectionError("connection reset by peer")

    publisher.submit(Batch([StartedRequest("r", 7, 0)], events("r", 0, 1)))
    monkeypatch.setattr(SentTransaction, "replies", lost)
    with pytest.raises(TransportError):
        publisher.submit(batch(2))
    monkeypatch.setattr(SentTransaction, "replies", read)
    assert publisher.drain()

    record = read_record(client, "r", keys=keys)
    assert record is not None and [event.seq for event in record.events] == [0, 1, 2]
    heard = [m for m in iter(lambda: listener.get_message(timeout=0.05), None) if m["type"] == "message"]
    assert len(heard) == 3
