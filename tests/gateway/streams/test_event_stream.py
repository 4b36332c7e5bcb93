from __future__ import annotations

import asyncio

import pytest

from metrale.gateway.streams.event_stream import EventStream
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
