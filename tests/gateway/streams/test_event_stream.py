from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest

from metrale.gateway.streams.event_stream import EventStream
from metrale.shared.errors import NoWorker
from metrale.shared.messages import TokenEvent

RID = "chatcmpl-1"

TIMERS = pytest.mark.parametrize("one_timer", [True, False], ids=["one-timer", "timer-per-wait"])
"""The stream's fast path (one timer, moved when it fires early) and its reference (one per wait)."""


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


@TIMERS
def test_a_quiet_reader_asks_for_a_fill_and_gets_what_it_brings(one_timer: bool) -> None:
    async def scenario() -> tuple[int, int]:
        fills = 0

        async def fill() -> None:
            nonlocal fills
            fills += 1
            if fills == 2:  # the second read of the record finds the event
                stream.note_record([event(0)])

        stream = EventStream(RID, fill=fill, idle_fill_s=0.02, one_timer=one_timer)
        got = await asyncio.wait_for(stream.next(), 1.0)
        return got.seq, fills

    assert asyncio.run(scenario()) == (0, 2)


@TIMERS
def test_a_reader_past_its_deadline_gets_a_timeout_and_no_fill(one_timer: bool) -> None:
    async def scenario() -> int:
        fills = 0

        async def fill() -> None:
            nonlocal fills
            fills += 1

        stream = EventStream(RID, fill=fill, idle_fill_s=10.0, one_timer=one_timer)
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


@TIMERS
def test_steady_events_ask_for_no_fill_and_silence_asks_after_idle_fill_s(one_timer: bool) -> None:
    """Events every 5 ms for 0.2 s with a 50 ms idle fill: no fill while they come; then, with the next
    event missing, fills 50 ms apart, the first 50 ms after the reader began to wait — the same for
    one timer moved along as for a timer per wait."""

    async def scenario() -> tuple[int, list[float]]:
        loop = asyncio.get_running_loop()
        fills: list[float] = []

        async def fill() -> None:
            fills.append(loop.time())

        stream = EventStream(RID, fill=fill, idle_fill_s=0.05, one_timer=one_timer)

        async def produce() -> None:
            for seq in range(40):
                await asyncio.sleep(0.005)
                stream.offer([event(seq)])

        producer = asyncio.ensure_future(produce())
        for _ in range(40):
            await stream.next()
        fills_while_steady = len(fills)
        await producer
        waited_at = loop.time()
        with pytest.raises(TimeoutError):
            await stream.next(deadline=waited_at + 0.13)
        return fills_while_steady, [at - waited_at for at in fills]

    steady, after_silence = asyncio.run(scenario())
    assert steady == 0
    assert len(after_silence) == 2
    assert 0.05 <= after_silence[0] < 0.09
    assert 0.10 <= after_silence[1] < 0.13


def test_one_timer_arms_a_timer_per_idle_fill_not_per_event() -> None:
    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        armed = 0
        call_at = loop.call_at

        def counting_call_at(when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
            nonlocal armed
            armed += 1
            return call_at(when, callback, *args)

        loop.call_at = counting_call_at  # type: ignore[method-assign,assignment]
        stream = EventStream(RID, fill=None, idle_fill_s=10.0)

        async def produce() -> None:
            for seq in range(100):
                await asyncio.sleep(0)
                stream.offer([event(seq)])

        producer = asyncio.ensure_future(produce())
        for _ in range(100):
            await stream.next(deadline=loop.time() + 60)
        await producer
        return armed

    assert asyncio.run(scenario()) == 1


def test_a_stream_no_longer_read_keeps_no_timer_past_idle_fill_s() -> None:
    """Without a fill the wake time is the deadline; the one timer is still armed at most ``idle_fill_s``
    ahead (and again while the reader waits), so a reader still times out at its deadline, and a stream
    left after its last event fires its timer soon and arms no other."""

    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        stream = EventStream(RID, fill=None, idle_fill_s=0.02)
        began = loop.time()
        with pytest.raises(TimeoutError):
            await stream.next(deadline=began + 0.1)
        timed_out_after = loop.time() - began
        reader = asyncio.ensure_future(stream.next(deadline=loop.time() + 600))
        await asyncio.sleep(0)  # the reader waits: the timer is armed
        stream.offer([event(0)])
        await reader
        assert stream._timer is not None
        armed_ahead = stream._timer.when() - loop.time()
        await asyncio.sleep(0.05)
        assert stream._timer is None  # fired with no reader waiting, not armed again
        return timed_out_after, armed_ahead

    timed_out_after, armed_ahead = asyncio.run(scenario())
    assert 0.1 <= timed_out_after < 0.3
    assert armed_ahead <= 0.02


def test_a_closed_stream_is_held_by_no_timer() -> None:
    """Closing a stream whose reader just got its last event cancels its armed timer: nothing on the
    event loop keeps the stream (and the events it held) alive after its request is done."""

    async def scenario() -> bool:
        loop = asyncio.get_running_loop()
        stream = EventStream(RID, fill=None, idle_fill_s=30.0)
        reader = asyncio.ensure_future(stream.next(deadline=loop.time() + 600))
        await asyncio.sleep(0)  # the reader waits: the timer is armed
        stream.offer([event(0), event(2)])
        await reader
        gone = weakref.ref(stream)
        stream.close()
        del stream, reader
        gc.collect()
        return gone() is None

    assert asyncio.run(scenario())
