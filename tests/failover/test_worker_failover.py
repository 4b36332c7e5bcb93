"""Worker threads over one fakeredis server: a request whose worker dies, or stops, continues on
another worker with exactly the tokens of an undisturbed run, its ``seq`` unbroken; a request that
keeps losing its workers ends with an error and a dead-letter entry."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest

from metrale.shared.codec import decode
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import FinishReason, GenerateRequest, Priority, TokenEvent
from metrale.shared.record import RunRecord
from metrale.worker.fleet.broker.redis_transport import RedisTransport
from metrale.worker.fleet.transport import StartedRequest
from tests.failover.rig import (
    DECODE_INTERVAL,
    HEARTBEAT_TTL_S,
    MODEL,
    Fleet,
    KillableTransport,
    RunningWorker,
    wait_for,
)

PROMPT = list(range(40, 75))


@pytest.fixture
def keys() -> Keys:
    return Keys(f"met-test-{uuid.uuid4().hex}")


@pytest.fixture
def fleet(tiny_model_dir: Path, keys: Keys) -> Fleet:
    return Fleet(tiny_model_dir, keys)


@pytest.fixture
def family_fleet(family_model_dir: Path, keys: Keys) -> Fleet:
    """A fleet serving the tiny model of each family in turn."""
    return Fleet(family_model_dir, keys)


@pytest.fixture
def running() -> Iterator[list[RunningWorker]]:
    """Workers a test started; stopped at its end."""
    workers: list[RunningWorker] = []
    yield workers
    for worker in workers:
        worker.stop.set()
    for worker in workers:
        worker.join()


def message(request_id: str, *, seed: int | None = 31, max_tokens: int = 16, n: int = 1) -> GenerateRequest:
    return GenerateRequest(
        request_id, MODEL, "acme", PROMPT, max_tokens=max_tokens, temperature=0.9, seed=seed, n=n, ignore_eos=True
    )


def tokens_sent(transport: KillableTransport) -> int:
    return sum(len(event.token_ids) for event in transport.published)


def assert_continued_exactly(fleet: Fleet, sent: GenerateRequest, record: RunRecord) -> None:
    """One event per seq, no write repeated, and the tokens of an undisturbed run with its seed."""
    assert record.is_contiguous and fleet.raw_event_count(sent.request_id) == len(record.events)
    assert record.seed is not None and (sent.seed is None or record.seed == sent.seed)
    assert record.token_ids(0) == fleet.reference(sent, record.seed)
    assert record.finish_reason is FinishReason.LENGTH


def killed_after_two_checkpoints(
    fleet: Fleet, sent: GenerateRequest, running: list[RunningWorker]
) -> tuple[RunRecord, RunningWorker]:
    """``sent`` on a worker killed once it sent 2 decode intervals and one token, then continued by an heir
    to its end: the finished record, and the heir."""
    doomed = fleet.start("doomed", kill_when=lambda transport: tokens_sent(transport) >= 2 * DECODE_INTERVAL + 1)
    fleet.submit(sent)
    doomed.join()
    heir = fleet.start("heir")
    running.append(heir)
    return fleet.finished_record(sent.request_id), heir


@pytest.mark.parametrize("seed", [31, None], ids=["seeded", "seed-drawn-by-the-worker"])
def test_a_request_whose_worker_died_continues_elsewhere_from_its_decode_checkpoint(
    family_fleet: Fleet, running: list[RunningWorker], seed: int | None
) -> None:
    """Over every family: the heir resumes from the newest decode checkpoint and feeds one token again."""
    fleet = family_fleet
    sent = message("killed-midway", seed=seed)
    record, heir = killed_after_two_checkpoints(fleet, sent, running)

    assert_continued_exactly(fleet, sent, record)
    workers = [event.worker_id for event in record.events]
    assert workers == ["doomed"] * (2 * DECODE_INTERVAL + 1) + ["heir"] * (len(workers) - 2 * DECODE_INTERVAL - 1)
    counters = heir.worker.failover
    assert counters.resumed_requests == 1
    assert counters.resume_checkpoint_tokens == len(PROMPT) + 2 * DECODE_INTERVAL  # the newest decode checkpoint
    assert counters.resume_prefill_tokens == 1  # only the last emitted token, which the dead worker never fed


@pytest.mark.parametrize("stream_interval", [3, 7])
def test_tokens_held_back_by_a_stream_interval_are_regenerated_exactly_after_a_kill(
    tiny_model_dir: Path, keys: Keys, running: list[RunningWorker], stream_interval: int
) -> None:
    """A worker sending tokens in events of several dies: what it held back was never sent, and the heir,
    resuming from the newest decode checkpoint (whose tokens the record holds: that step sent them),
    sends it as the undisturbed run would."""
    fleet = Fleet(tiny_model_dir, keys, stream_interval=stream_interval)
    sent = message("killed-holding", max_tokens=24)
    record, heir = killed_after_two_checkpoints(fleet, sent, running)

    assert_continued_exactly(fleet, sent, record)
    doomed_tokens = sum(len(event.token_ids) for event in record.events if event.worker_id == "doomed")
    assert doomed_tokens == 2 * DECODE_INTERVAL + 1  # the step of the checkpoint after 8 tokens sent the 9th
    assert heir.worker.failover.resume_checkpoint_tokens == len(PROMPT) + 2 * DECODE_INTERVAL
    assert heir.worker.failover.resume_prefill_tokens == 1


@pytest.mark.parametrize("stream_interval", [1, 5])
def test_a_stopping_worker_hands_its_requests_back_and_another_finishes_them(
    tiny_model_dir: Path, keys: Keys, running: list[RunningWorker], stream_interval: int
) -> None:
    """With a stream interval, what a request holds back is sent before it is handed back."""
    fleet = Fleet(tiny_model_dir, keys, drain_handoff=True, drain_timeout_s=60.0, stream_interval=stream_interval)
    sent = [message("handed-back-0", max_tokens=24), message("handed-back-1", seed=None, max_tokens=24)]
    stopping = fleet.start("stopping")
    for request in sent:
        fleet.submit(request)
    wait_for(lambda: all(len(r.events) >= 3 for r in map(fleet.record, ("handed-back-0", "handed-back-1")) if r))

    stopping.stop.set()
    stopping.join()
    heir = fleet.start("heir")
    running.append(heir)

    for request in sent:
        record = fleet.finished_record(request.request_id)
        assert_continued_exactly(fleet, request, record)
        assert {event.worker_id for event in record.events} == {"stopping", "heir"}
    assert stopping.worker.failover.handed_back_requests == 2
    assert heir.worker.failover.resumed_requests == 2
    assert heir.worker.failover.resume_prefill_tokens == 2  # each resumed from its exact state at the stop


def take_and_lose(fleet: Fleet, sent: GenerateRequest, losses: int) -> None:
    """Let ``losses`` workers take ``sent`` and die: the first sends one token, the others nothing."""
    first = RedisTransport(fakeredis.FakeRedis(server=fleet.server), worker_id="lost-1", keys=fleet.keys)
    (taken,) = first.receive(1, block_ms=0)
    assert taken == sent
    first.begin([StartedRequest(sent.request_id, seed=77, cached_tokens=0)])
    first.publish([TokenEvent(sent.request_id, 0, 0, [101], "lost-1")], [])
    stream = fleet.keys.request_stream(Priority.INTERACTIVE)
    ((entry_id, _),) = fleet.client.xrange(stream)
    for loss in range(2, losses + 1):
        fleet.client.xclaim(stream, WORKER_GROUP, f"lost-{loss}", 0, [entry_id])


@pytest.mark.parametrize(
    ("losses", "dead_lettered"), [(2, False), (3, True)], ids=["lost-twice-continues", "lost-three-times-given-up"]
)
def test_a_request_that_keeps_losing_its_workers_is_given_up_with_an_error(
    fleet: Fleet, running: list[RunningWorker], losses: int, dead_lettered: bool
) -> None:
    sent = message("unlucky", seed=None, max_tokens=6)
    fleet.submit(sent)
    take_and_lose(fleet, sent, losses)
    heir = fleet.start("heir")
    running.append(heir)

    record = fleet.finished_record(sent.request_id, timeout_s=HEARTBEAT_TTL_S * 30)

    dead = fleet.client.xrange(fleet.keys.dead_letter())
    assert fleet.client.xpending(fleet.keys.request_stream(Priority.INTERACTIVE), WORKER_GROUP)["pending"] == 0
    if not dead_lettered:
        assert (record.finish_reason, record.is_contiguous, dead) == (FinishReason.LENGTH, True, [])
        tokens = record.token_ids(0)
        assert tokens[0] == 101 and len(tokens) == sent.max_tokens  # went on after the lost worker's token
        return
    assert (record.finish_reason, record.next_seq) == (FinishReason.ERROR, 2)
    assert record.error is not None and f"given to {losses + 1} workers" in record.error
    ((_, fields),) = dead
    assert decode(fields[b"raw"]) == sent and fields[b"reason"].decode() == record.error
    assert heir.worker.failover.dead_lettered_requests == 1


@pytest.mark.parametrize("sent_events", [True, False], ids=["after-sending", "before-sending"])
def test_a_request_with_several_choices_continues_only_if_it_sent_nothing_yet(
    fleet: Fleet, running: list[RunningWorker], sent_events: bool
) -> None:
    sent = message("two-choices", n=2, max_tokens=4)
    fleet.submit(sent)
    lost = RedisTransport(fakeredis.FakeRedis(server=fleet.server), worker_id="lost", keys=fleet.keys)
    lost.receive(1, block_ms=0)
    lost.begin([StartedRequest(sent.request_id, seed=31, cached_tokens=0)])
    if sent_events:
        lost.publish([TokenEvent(sent.request_id, 0, 0, [101], "lost")], [])
    running.append(fleet.start("heir"))

    record = fleet.finished_record(sent.request_id)

    if sent_events:
        assert record.finish_reason is FinishReason.ERROR
        assert record.error is not None and "n > 1" in record.error
        assert [event.finish_reason for event in record.events[1:]] == [FinishReason.ERROR] * 2
    else:
        assert record.finish_reason is FinishReason.LENGTH
        assert [len(record.token_ids(choice)) for choice in range(2)] == [4, 4]
