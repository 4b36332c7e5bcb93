"""The background publisher: batches written in the order submitted, each once, across failures;
backpressure; the barriers ``drain`` and ``close``. On an in-memory transport, and on the Redis one
over fakeredis (records in ``seq`` order across an outage)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, GenerateRequest, Priority, TokenEvent
from metrale.shared.record import RunStatus, read_record
from metrale.worker.fleet.outbox import Batch
from metrale.worker.fleet.publisher import BackgroundPublisher, PublisherFailed
from metrale.worker.fleet.redis_transport import RedisTransport
from metrale.worker.fleet.transport import FinishedRequest, InMemoryTransport, StartedRequest, TransportError

WAIT_S = 5.0


class GatedTransport(InMemoryTransport):
    """Publishes only while ``gate`` is open; fails the next ``failures`` publishes (or raises
    ``error`` on every one when set); logs every write call in ``calls``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.failures = 0
        self.error: Exception | None = None
        self.calls: list[str] = []
        self.attempts = 0

    def begin(self, started: Sequence[StartedRequest]) -> None:
        self.calls.append("begin")
        super().begin(started)

    def publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> None:
        assert self.gate.wait(WAIT_S)
        self.attempts += 1
        if self.error is not None:
            raise self.error
        if self.failures:
            self.failures -= 1
            self.calls.append("publish-failed")
            raise TransportError("connection refused")
        self.calls.append("publish")
        super().publish(events, finished)

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
def transport() -> GatedTransport:
    return GatedTransport()


@pytest.fixture
def publisher(transport: GatedTransport) -> Iterator[BackgroundPublisher]:
    publisher = BackgroundPublisher(transport, max_queued=2)
    yield publisher
    transport.gate.set()
    publisher.close(WAIT_S)


def wait_until(condition: object, what: str) -> None:
    assert callable(condition)
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# --- order ----------------------------------------------------------------------------------------


def test_batches_are_written_in_the_order_submitted_each_once(
    publisher: BackgroundPublisher, transport: GatedTransport
) -> None:
    for step in range(30):
        publisher.submit(Batch(events=events("a", step) + events("b", 2 * step, 2 * step + 1)))
    publisher.submit(Batch())  # nothing to write: nothing queued

    assert publisher.drain(WAIT_S)
    assert seqs_of(transport, "a") == list(range(30))
    assert seqs_of(transport, "b") == list(range(60))
    assert len(transport.publishes) == 30  # one publish per batch, never merged or split


def test_a_batch_writes_seeds_then_events_and_finishes_then_hand_backs(
    publisher: BackgroundPublisher, transport: GatedTransport
) -> None:
    done = FinishedRequest("r", FinishReason.LENGTH)
    publisher.submit(Batch([StartedRequest("r", 7, 0)], events("r", 0, 1), [done], ["other"]))

    assert publisher.drain(WAIT_S)
    assert transport.calls == ["begin", "publish", "hand_back"]
    assert transport.publishes == [(events("r", 0, 1), [done])]
    assert publisher.take_handed_back() == 1
    assert publisher.take_handed_back() == 0


# --- backpressure and barriers ----------------------------------------------------------------------


def test_submit_waits_while_more_than_max_queued_batches_are_unsent(
    publisher: BackgroundPublisher, transport: GatedTransport
) -> None:
    transport.gate.clear()
    publisher.submit(batch(0))  # being written (held at the gate)
    publisher.submit(batch(1))  # queued behind it: two unsent, as many as allowed
    third = threading.Thread(target=publisher.submit, args=(batch(2),))
    third.start()
    time.sleep(0.1)
    assert third.is_alive() and publisher.unsent == 3

    transport.gate.set()
    third.join(WAIT_S)
    assert not third.is_alive()
    assert publisher.drain(WAIT_S)
    assert seqs_of(transport) == [0, 1, 2]


def test_drain_returns_only_once_everything_submitted_is_written(
    publisher: BackgroundPublisher, transport: GatedTransport
) -> None:
    transport.gate.clear()
    publisher.submit(batch(0))
    publisher.submit(batch(1))

    assert not publisher.drain(0.1)
    assert seqs_of(transport) == []
    threading.Timer(0.1, transport.gate.set).start()
    assert publisher.drain()
    assert seqs_of(transport) == [0, 1] and publisher.unsent == 0


def test_close_writes_what_is_queued_then_stops(transport: GatedTransport) -> None:
    publisher = BackgroundPublisher(transport)
    transport.gate.clear()
    publisher.submit(batch(0))
    publisher.submit(batch(1))
    threading.Timer(0.1, transport.gate.set).start()

    assert publisher.close(WAIT_S)
    assert seqs_of(transport) == [0, 1]


def test_a_publisher_never_given_a_batch_starts_no_thread_and_closes_at_once(transport: GatedTransport) -> None:
    publisher = BackgroundPublisher(transport)
    publisher.submit(Batch())
    assert publisher.drain(0)
    assert publisher.close(0)
    assert transport.calls == []


# --- failures -------------------------------------------------------------------------------------


def test_a_failed_batch_is_retried_in_order_only_after_the_loop_was_told(
    publisher: BackgroundPublisher, transport: GatedTransport
) -> None:
    transport.failures = 2
    publisher.submit(batch(0))
    wait_until(lambda: transport.attempts == 1, "the first attempt")
    time.sleep(0.05)
    assert transport.attempts == 1  # parked: no retry before the loop has seen the failure

    with pytest.raises(TransportError, match="connection refused"):
        publisher.submit(batch(1))  # queued all the same, behind the failed one
    time.sleep(0.05)
    assert transport.attempts == 1 and publisher.unsent == 2  # the loop backs off before its next call

    with pytest.raises(TransportError):
        publisher.drain(WAIT_S)  # resumed; batch 0 fails again
    assert publisher.drain(WAIT_S)  # resumed; written now
    assert seqs_of(transport) == [0, 1]
    assert transport.calls == ["publish-failed", "publish-failed", "publish", "publish"]


def test_a_retried_batch_writes_only_what_it_had_not_written(
    publisher: BackgroundPublisher, transport: GatedTransport
) -> None:
    transport.failures = 1
    publisher.submit(Batch([StartedRequest("r", 7, 0)], events("r", 0), [], ["r"]))
    with pytest.raises(TransportError):
        publisher.drain(WAIT_S)
    assert publisher.drain(WAIT_S)

    assert transport.calls == ["begin", "publish-failed", "publish", "hand_back"]
    assert seqs_of(transport) == [0]


def test_a_submit_waiting_for_room_is_woken_by_a_failure_and_raises_it(
    publisher: BackgroundPublisher, transport: GatedTransport
) -> None:
    transport.gate.clear()
    transport.failures = 1
    publisher.submit(batch(0))
    publisher.submit(batch(1))
    raised: list[Exception] = []

    def submit_third() -> None:
        try:
            publisher.submit(batch(2))
        except TransportError as exc:
            raised.append(exc)

    third = threading.Thread(target=submit_third)
    third.start()
    time.sleep(0.05)
    assert third.is_alive()  # no room: two batches unsent
    transport.gate.set()  # batch 0 fails
    third.join(WAIT_S)

    assert [str(exc) for exc in raised] == ["connection refused"]
    assert publisher.unsent == 3  # batch 2 is queued all the same
    assert publisher.drain(WAIT_S)
    assert seqs_of(transport) == [0, 1, 2]


def test_close_gives_up_on_a_batch_that_failed(transport: GatedTransport) -> None:
    publisher = BackgroundPublisher(transport)
    transport.failures = 1
    publisher.submit(batch(0))
    wait_until(lambda: transport.attempts == 1, "the failed attempt")

    started = time.monotonic()
    assert not publisher.close(WAIT_S)
    assert time.monotonic() - started < 1.0
    assert publisher.unsent == 1


def test_an_error_retrying_cannot_cure_stops_the_publisher_for_good(
    publisher: BackgroundPublisher, transport: GatedTransport
) -> None:
    transport.error = ValueError("WRONGTYPE")
    publisher.submit(batch(0))

    with pytest.raises(PublisherFailed, match="WRONGTYPE"):
        publisher.drain(WAIT_S)
    with pytest.raises(PublisherFailed):
        publisher.submit(batch(1))


def test_max_queued_must_allow_one_batch() -> None:
    with pytest.raises(ValueError, match="max_queued"):
        BackgroundPublisher(InMemoryTransport(), max_queued=0)


# --- over the Redis transport (fakeredis) -----------------------------------------------------------


def test_over_redis_a_requests_record_holds_its_events_in_seq_order_across_an_outage() -> None:
    server = fakeredis.FakeServer()
    client: redis.Redis = fakeredis.FakeRedis(server=server, retry=Retry(NoBackoff(), 0))
    keys = Keys("met-test-publisher")
    request = GenerateRequest("r", "m", "t", [1, 2], max_tokens=8)
    client.xadd(keys.request_stream(Priority.INTERACTIVE), {"msg": encode(request)})
    transport = RedisTransport(client, worker_id="w", keys=keys)
    assert len(transport.receive(1, block_ms=0)) == 1
    publisher = BackgroundPublisher(transport)
    listener = client.pubsub()
    listener.subscribe(keys.token_channel("r"))

    publisher.submit(Batch([StartedRequest("r", 7, 0)], events("r", 0, 1)))
    publisher.submit(batch(2, 3))
    assert publisher.drain(WAIT_S)
    server.connected = False  # Redis goes away
    publisher.submit(batch(4, 5))
    with pytest.raises(TransportError):
        publisher.drain(WAIT_S)
    publisher.submit(batch(6))  # the loop steps on: queued behind the failed batch
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
