from __future__ import annotations

import asyncio

import pytest

from metrale.gateway.streams.event_stream import EventStream
from metrale.shared.errors import NoWorker
from metrale.shared.messages import TokenEvent

RID = "chatcmpl-1"


def event(seq: int, request_id: str = RID) -> TokenEvent:
    return TokenEvent(request_id=request_id, index=0, seq=seq, token_ids=[seq], worker_id="w")


def drain(stream: EventStream) -> list[int]:
    async def take() -> list[int]:
        seqs = []
        while True:
            try:
                seqs.append((await asyncio.wait_for(stream.next(), 0.01)).seq)
            except TimeoutError:
                return seqs

    return asyncio.run(take())


@pytest.mark.parametrize(
    ("arrivals", "released", "gap"),
    [
        pytest.param([0, 1, 2], [0, 1, 2], False, id="in-order"),
        pytest.param([0, 0, 1, 1, 0], [0, 1], False, id="duplicates-dropped"),
        pytest.param([0, 2, 3], [0], True, id="gap-holds-later-events"),
        pytest.param([0, 2, 1], [0, 1, 2], False, id="late-event-fills-gap"),
        pytest.param([3, 1, 2, 0], [0, 1, 2, 3], False, id="fully-reversed"),
    ],
)
def test_each_seq_is_released_once_in_order(arrivals: list[int], released: list[int], gap: bool) -> None:
    stream = EventStream(RID)
    for seq in arrivals:
        stream.offer([event(seq)])
    assert drain(stream) == released
    assert stream.has_gap == gap
    assert stream.next_seq == len(released)


def test_events_of_other_requests_are_ignored() -> None:
    stream = EventStream(RID)
    stream.offer([event(0, "chatcmpl-2"), event(0)])
    assert drain(stream) == [0]


def test_a_waiting_reader_wakes_when_its_next_event_arrives() -> None:
    async def scenario() -> list[int]:
        stream = EventStream(RID)
        reader = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0.01)
        stream.offer([event(1)])  # not the next one: the reader keeps waiting
        await asyncio.sleep(0.01)
        assert not reader.done()
        stream.offer([event(0)])
        return [(await reader).seq, (await stream.next()).seq]

    assert asyncio.run(scenario()) == [0, 1]


def test_a_quiet_reader_asks_for_a_fill_and_gets_what_it_brings() -> None:
    async def scenario() -> tuple[int, int]:
        fills = 0

        async def fill() -> None:
            nonlocal fills
            fills += 1
            if fills == 2:  # the second read of the record finds the event
                stream.note_record([event(0)])

        stream = EventStream(RID, fill=fill, idle_fill_s=0.02)
        got = await asyncio.wait_for(stream.next(), 1.0)
        return got.seq, fills

    assert asyncio.run(scenario()) == (0, 2)


def test_a_reader_past_its_deadline_gets_a_timeout_and_no_fill() -> None:
    async def scenario() -> int:
        fills = 0

        async def fill() -> None:
            nonlocal fills
            fills += 1

        stream = EventStream(RID, fill=fill, idle_fill_s=10.0)
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await stream.next(deadline=loop.time() + 0.02)
        stream.offer([event(0)])
        assert (await stream.next(deadline=loop.time() - 1)).seq == 0  # an event ready is never late
        return fills

    assert asyncio.run(scenario()) == 0


def test_a_record_showing_the_request_lost_wakes_the_reader_with_no_worker() -> None:
    async def scenario() -> None:
        stream = EventStream(RID, fill=None)
        reader = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0.01)
        stream.note_record([event(1)])  # later events, not the next one: lost for good
        with pytest.raises(NoWorker):
            await asyncio.wait_for(reader, 1.0)

    asyncio.run(scenario())
