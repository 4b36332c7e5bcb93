from __future__ import annotations

import asyncio
import logging

import fakeredis
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, TokenEvent, Usage
from metrale.shared.record import (
    RunRecord,
    RunStatus,
    append_encoded,
    append_tokens,
    parse_record,
    read_events_from_async,
    read_record,
    read_record_async,
    refresh_record,
    set_status,
)
from tests.shared.conftest import AsyncClientFactory
from tests.shared.strategies import token_events

RID = "req-7"


def event(seq: int, tokens: list[int], *, index: int = 0, final: FinishReason | None = None) -> TokenEvent:
    return TokenEvent(
        request_id=RID,
        index=index,
        seq=seq,
        token_ids=tokens,
        worker_id="w-1",
        logprobs=[-1.0] * len(tokens),
        finished=final is not None,
        finish_reason=final,
        usage=Usage(3, 4, 0) if final else None,
    )


def write(client: redis.Redis, *events: TokenEvent, keys: Keys | None = None) -> None:
    with client.pipeline() as pipe:
        for ev in events:
            append_tokens(pipe, ev, keys=keys or Keys())
        pipe.execute()


def read(client: redis.Redis, keys: Keys | None = None) -> RunRecord:
    record = read_record(client, RID, keys=keys or Keys())
    assert record is not None
    return record


def test_events_come_back_in_seq_order_with_their_tokens(redis_client: redis.Redis) -> None:
    events = [
        event(0, [1, 2]),
        event(1, [9], index=1),
        event(2, [3]),
        event(3, [4], final=FinishReason.LENGTH),
    ]
    write(redis_client, events[0], events[2], events[1], events[3])
    record = read(redis_client)
    assert record.events == tuple(events)
    assert record.token_ids(0) == [1, 2, 3, 4] and record.token_ids(1) == [9]
    assert record.next_seq == 4 and record.is_contiguous
    assert record.is_choice_finished(0) and not record.is_choice_finished(1)
    assert record.events_after(1) == events[2:]
    assert (record.worker_id, record.status, record.finish_reason) == ("w-1", None, None)


def test_a_repeated_append_is_read_once(redis_client: redis.Redis) -> None:
    write(redis_client, event(0, [1]), event(1, [2]), event(1, [2]))  # e.g. a retried pipeline
    record = read(redis_client)
    assert [ev.seq for ev in record.events] == [0, 1]
    assert record.token_ids() == [1, 2]


def test_a_hole_in_the_events_is_visible(redis_client: redis.Redis) -> None:
    write(redis_client, event(0, [1]), event(2, [3]))
    record = read(redis_client)
    assert not record.is_contiguous
    assert record.next_seq == 3


def test_status_moves_through_a_run(redis_client: redis.Redis) -> None:
    with redis_client.pipeline() as pipe:
        set_status(pipe, RID, RunStatus.QUEUED)
        pipe.execute()
    assert (read(redis_client).status, read(redis_client).worker_id) == (RunStatus.QUEUED, None)

    with redis_client.pipeline() as pipe:
        set_status(pipe, RID, RunStatus.RUNNING, worker_id="w-2")
        append_tokens(pipe, event(0, [5], final=FinishReason.ERROR))
        set_status(pipe, RID, RunStatus.FINISHED, finish_reason=FinishReason.ERROR, error="out of memory")
        pipe.execute()
    record = read(redis_client)
    assert (record.status, record.finish_reason, record.error) == (
        RunStatus.FINISHED,
        FinishReason.ERROR,
        "out of memory",
    )
    assert record.worker_id == "w-1"  # the worker that wrote the last event

    with redis_client.pipeline() as pipe:  # requeued after failover: the old outcome is cleared
        set_status(pipe, RID, RunStatus.QUEUED)
        pipe.execute()
    record = read(redis_client)
    assert (record.status, record.finish_reason, record.error) == (RunStatus.QUEUED, None, None)
    assert record.token_ids() == [5]


@pytest.mark.parametrize(
    ("status", "reason", "error"),
    [
        pytest.param(RunStatus.FINISHED, None, None, id="finished-without-reason"),
        pytest.param(RunStatus.RUNNING, FinishReason.STOP, None, id="reason-while-running"),
        pytest.param(RunStatus.FINISHED, FinishReason.STOP, "boom", id="error-with-stop"),
    ],
)
def test_set_status_rejects_inconsistent_outcomes(
    redis_client: redis.Redis, status: RunStatus, reason: FinishReason | None, error: str | None
) -> None:
    with redis_client.pipeline() as pipe, pytest.raises(ValueError):
        set_status(pipe, RID, status, finish_reason=reason, error=error)


def test_nothing_is_visible_before_the_pipeline_runs(redis_client: redis.Redis) -> None:
    with redis_client.pipeline() as pipe:
        append_tokens(pipe, event(0, [1]))
        set_status(pipe, RID, RunStatus.RUNNING, worker_id="w-1")
        assert read_record(redis_client, RID) is None
        pipe.execute()
    assert read(redis_client).status is RunStatus.RUNNING


def test_both_keys_expire_and_each_write_refreshes_them(redis_client: redis.Redis) -> None:
    keys = Keys()
    with redis_client.pipeline() as pipe:
        append_tokens(pipe, event(0, [1]), ttl_s=30)
        pipe.execute()
    for key in (keys.run_record(RID), keys.run_events(RID)):
        assert 0 < redis_client.ttl(key) <= 30
    with redis_client.pipeline() as pipe:
        set_status(pipe, RID, RunStatus.RUNNING, ttl_s=900)
        pipe.execute()
    for key in (keys.run_record(RID), keys.run_events(RID)):
        assert 30 < redis_client.ttl(key) <= 900


def test_missing_record_reads_as_none(redis_client: redis.Redis) -> None:
    assert read_record(redis_client, "never-sent") is None


def test_namespaces_keep_records_apart(redis_client: redis.Redis) -> None:
    write(redis_client, event(0, [1]), keys=Keys("other"))
    assert read_record(redis_client, RID) is None
    assert read(redis_client, Keys("other")).token_ids() == [1]


def test_a_damaged_entry_is_skipped_and_logged(redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    write(redis_client, event(0, [1]))
    redis_client.rpush(Keys().run_events(RID), b"\xc1garbage")
    write(redis_client, event(1, [2]))
    with caplog.at_level(logging.WARNING, logger="metrale.shared.record"):
        record = read(redis_client)
    assert record.token_ids() == [1, 2]
    assert "not a token event" in caplog.text


def test_async_reader_matches_the_sync_reader(
    redis_client: redis.Redis, async_redis_client: AsyncClientFactory
) -> None:
    write(redis_client, event(0, [1, 2]), event(1, [3], final=FinishReason.STOP))
    with redis_client.pipeline() as pipe:
        set_status(pipe, RID, RunStatus.FINISHED, worker_id="w-1", finish_reason=FinishReason.STOP)
        pipe.execute()

    async def read_async() -> tuple[RunRecord | None, RunRecord | None]:
        async with async_redis_client() as client:
            return await read_record_async(client, RID), await read_record_async(client, "missing")

    found, missing = asyncio.run(read_async())
    assert found == read(redis_client)
    assert missing is None


def test_async_pipelines_take_the_same_writers(
    redis_client: redis.Redis, async_redis_client: AsyncClientFactory
) -> None:
    async def write_async() -> None:
        async with async_redis_client() as client, client.pipeline() as pipe:
            append_tokens(pipe, event(0, [4]))
            set_status(pipe, RID, RunStatus.RUNNING, worker_id="w-1")
            await pipe.execute()

    asyncio.run(write_async())
    record = read(redis_client)
    assert (record.status, record.token_ids()) == (RunStatus.RUNNING, [4])


def events_from(async_redis_client: AsyncClientFactory, next_seq: int) -> tuple[TokenEvent, ...] | None:
    async def read_async() -> tuple[TokenEvent, ...] | None:
        async with async_redis_client() as client:
            return await read_events_from_async(client, RID, next_seq)

    return asyncio.run(read_async())


def test_a_reader_gets_the_events_from_its_next_seq_on(
    redis_client: redis.Redis, async_redis_client: AsyncClientFactory
) -> None:
    events = [event(seq, [seq + 10]) for seq in range(6)]
    write(redis_client, *events)
    assert events_from(async_redis_client, 0) == tuple(events)
    assert events_from(async_redis_client, 4) == tuple(events[4:])
    assert events_from(async_redis_client, 6) == ()  # the record exists and holds nothing new
    assert events_from(async_redis_client, 9) == tuple(events)  # shorter than the reader has: read whole
    redis_client.delete(Keys().run_events(RID), Keys().run_record(RID))
    assert events_from(async_redis_client, 0) is None and events_from(async_redis_client, 3) is None


@pytest.mark.parametrize(
    "written_seqs",
    [[0, 1, 1, 2, 3, 4], [0, 1, 2, 2, 3, 4], [3, 4, 5], [2, 3, 4, 5]],
    ids=["repeat-before", "repeat-at-anchor", "lost-start", "lost-start-aligned-length"],
)
def test_a_reader_gets_every_later_event_whatever_the_list_holds(
    redis_client: redis.Redis, async_redis_client: AsyncClientFactory, written_seqs: list[int]
) -> None:
    """Repeated appends (a retried pipeline, a zombie) and a list that lost its start (Redis restarted
    empty, the worker re-sent what was unsent) still give a reader at seq 3 every event from 3 on."""
    write(redis_client, *(event(seq, [seq + 10]) for seq in written_seqs))
    found = events_from(async_redis_client, 3)
    assert found is not None
    assert [e.seq for e in found] == sorted({e.seq for e in found})  # in order, one per seq
    assert [e for e in found if e.seq >= 3] == [event(seq, [seq + 10]) for seq in sorted(set(written_seqs)) if seq >= 3]


def test_append_encoded_leaves_worker_and_ttl_to_refresh_record(redis_client: redis.Redis) -> None:
    keys = Keys()
    with redis_client.pipeline() as pipe:
        append_encoded(pipe, RID, [encode(event(0, [1])), encode(event(1, [2]))])
        pipe.execute()
    assert redis_client.ttl(keys.run_events(RID)) == -1 and not redis_client.exists(keys.run_record(RID))
    with redis_client.pipeline() as pipe:
        refresh_record(pipe, RID, worker_id="w-9", ttl_s=40)
        pipe.execute()
    assert read(redis_client).token_ids() == [1, 2] and read(redis_client).worker_id == "w-9"
    assert 0 < redis_client.ttl(keys.run_events(RID)) <= 40 and 0 < redis_client.ttl(keys.run_record(RID)) <= 40


@settings(derandomize=True, deadline=None, max_examples=40)
@given(events=st.lists(token_events(request_ids=st.just(RID)), max_size=12), data=st.data())
def test_any_write_order_reads_back_sorted_and_unique(events: list[TokenEvent], data: st.DataObject) -> None:
    written = data.draw(st.permutations(events))
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    write(client, *written)
    first_per_seq: dict[int, TokenEvent] = {}
    for ev in written:
        first_per_seq.setdefault(ev.seq, ev)  # a later event reusing a seq is a duplicate
    record = read_record(client, RID)
    if not written:
        assert record is None
        return
    assert record is not None
    assert record.events == tuple(first_per_seq[seq] for seq in sorted(first_per_seq))


# --- fuzzed: whatever Redis holds, reading a record never raises -----------------------------------

raw_bytes = st.binary(max_size=64)
field_names = st.sampled_from([b"status", b"worker", b"finish_reason", b"error", b"seed", b"cached_tokens"]) | raw_bytes
field_values = (
    st.sampled_from([b"queued", b"running", b"finished", b"stop", b"length", b"12", b"-3", b"1e9"]) | raw_bytes
)


@settings(max_examples=500, deadline=None)
@given(
    fields=st.dictionaries(field_names, field_values, max_size=6),
    raw_events=st.lists(raw_bytes | token_events(request_ids=st.just(RID)).map(encode), max_size=6),
)
def test_arbitrary_record_bytes_never_raise_and_damage_is_reported(
    fields: dict[bytes, bytes], raw_events: list[bytes]
) -> None:
    reported: list[tuple[str, bytes]] = []
    record = parse_record(RID, fields, raw_events, on_damage=lambda reason, raw: reported.append((reason, raw)))
    if record is None:
        assert not fields and not raw_events
        return
    assert [reason for reason, _ in reported] == list(record.damage)
    assert all(isinstance(raw, bytes) for _, raw in reported)
    assert list(record.events) == sorted(record.events, key=lambda e: e.seq)
    assert record.cached_tokens >= 0


def test_unreadable_hash_fields_read_as_absent_and_are_named() -> None:
    fields = {b"status": b"teleported", b"seed": b"x", b"worker": b"w-1", b"error": b"\xff\xfe"}
    record = parse_record(RID, fields, [b"\xc1"])
    assert record is not None
    assert (record.status, record.seed, record.worker_id, record.error) == (None, None, "w-1", None)
    assert len(record.damage) == 4
    assert any("status" in reason for reason in record.damage) and any("seed" in r for r in record.damage)
