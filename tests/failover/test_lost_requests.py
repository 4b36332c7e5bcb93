"""A gateway stream whose request Redis lost (restarted empty) ends with a clear error, not at its
deadline: its record gone for a while, or holding later events but not the next one."""

from __future__ import annotations

import asyncio

import pytest

from metrale.gateway.streams.event_stream import LOST_EVENTS, LOST_RECORD, EventStream
from metrale.shared.errors import NoWorker
from metrale.shared.messages import TokenEvent

RID = "cmpl-1"
IDLE_S = 0.02


def event(seq: int) -> TokenEvent:
    return TokenEvent(RID, 0, seq, [seq], "w")


def read_all(records: list[list[TokenEvent] | None], *, lost_after_s: float) -> tuple[list[int], str | None]:
    """Read a stream whose fills return ``records`` one after another (the last one from then on)."""

    async def run() -> tuple[list[int], str | None]:
        reads = iter(records)
        last: list[TokenEvent] | None = None

        async def fill() -> None:
            nonlocal last
            last = next(reads, last)
            stream.note_record(last)

        stream = EventStream(RID, fill=fill, idle_fill_s=IDLE_S, lost_after_s=lost_after_s)
        seqs: list[int] = []
        try:
            async with asyncio.timeout(2):
                while len(seqs) < 3:
                    seqs.append((await stream.next()).seq)
        except NoWorker as error:
            return seqs, str(error)
        except TimeoutError:
            return seqs, None
        return seqs, None

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("records", "seqs", "lost"),
    [
        pytest.param([[event(0)], [event(0), event(1), event(2)]], [0, 1, 2], None, id="record-fills-the-stream"),
        pytest.param([None, None, [event(0), event(1), event(2)]], [0, 1, 2], None, id="record-back-in-time"),
        pytest.param([[event(0)], [event(2), event(3)]], [0], LOST_EVENTS, id="record-lost-events"),
        pytest.param([None], [], LOST_RECORD, id="record-gone-for-good"),
    ],
)
def test_a_lost_request_ends_with_an_error_and_a_slow_one_does_not(
    records: list[list[TokenEvent] | None], seqs: list[int], lost: str | None
) -> None:
    assert read_all(records, lost_after_s=0.5) == (seqs, lost)
