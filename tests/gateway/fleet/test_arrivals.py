"""Requests counted from arrival to judgement, and waiting for the arrivals at the door."""

from __future__ import annotations

import asyncio
import time

import pytest

from metrale.gateway.fleet.arrivals import QUIET_PASSES, RELEASE_PER_PASS, Arrivals

pytestmark = pytest.mark.anyio


def test_a_request_counts_until_judged_or_until_it_leaves() -> None:
    arrivals = Arrivals()
    with arrivals.arrived():
        assert arrivals.waiting == 1
        arrivals.judged()
        arrivals.judged()  # once only
        assert arrivals.waiting == 0
    with arrivals.arrived():  # never judged (a bad body): counted until it leaves
        assert arrivals.waiting == 1
    assert arrivals.waiting == 0 and arrivals.total == 2
    arrivals.judged()  # a request that never arrived here (a batch line): nothing to settle
    assert arrivals.waiting == 0


async def test_each_task_settles_its_own_ticket() -> None:
    arrivals = Arrivals()
    judged = asyncio.Event()

    async def request(judge: bool) -> None:
        with arrivals.arrived():
            await asyncio.sleep(0)
            if judge:
                arrivals.judged()
                judged.set()
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(request(judge)) for judge in (True, False)]
    await judged.wait()
    assert arrivals.waiting == 1  # the other one is still waiting for its judgement
    await asyncio.gather(*tasks)
    assert arrivals.waiting == 0


async def test_settled_waits_while_requests_keep_arriving() -> None:
    """Arrivals one event-loop pass apart keep ``settled`` waiting; it returns ``QUIET_PASSES``
    passes after the last, to every caller at once."""
    arrivals = Arrivals()
    log: list[str] = []

    async def arrive(count: int) -> None:
        for _ in range(count):
            with arrivals.arrived():
                log.append("arrived")
            await asyncio.sleep(0)

    async def wait(name: str) -> None:
        await arrivals.settled()
        log.append(name)

    await asyncio.gather(wait("first"), arrive(10), wait("second"))
    assert log[:10] == ["arrived"] * 10 and sorted(log[10:]) == ["first", "second"]
    passes = 0
    waiting = asyncio.ensure_future(arrivals.settled())
    while not waiting.done():
        passes += 1
        await asyncio.sleep(0)
    assert QUIET_PASSES <= passes <= QUIET_PASSES + 5  # nothing arriving: done within a few passes


async def test_the_expected_delay_is_the_requests_ahead_at_the_pace_of_busy_judgements() -> None:
    """The gaps between judgements made while others waited set the pace (an idle gateway's pause says
    nothing of it); an arrival waits one gap for each request ahead of it."""
    arrivals = Arrivals()
    assert arrivals.expected_delay_s() == 0.0
    turns = [asyncio.Event() for _ in range(4)]

    async def request(turn: asyncio.Event) -> None:
        with arrivals.arrived():
            await turn.wait()
            arrivals.judged()

    tasks = [asyncio.create_task(request(turn)) for turn in turns]
    await asyncio.sleep(0)
    assert arrivals.waiting == 4
    for turn in turns[:3]:  # judged 20 ms apart while others wait
        await asyncio.sleep(0.02)
        turn.set()
        await asyncio.sleep(0)
    assert arrivals.waiting == 1
    assert 0.015 <= arrivals.expected_delay_s() <= 0.2  # one ahead, at ~20 ms a judgement
    await asyncio.sleep(0.3)  # idle: the last one is judged alone, and its wait does not count
    turns[3].set()
    await asyncio.gather(*tasks)
    assert arrivals.waiting == 0 and arrivals.expected_delay_s() == 0.0
    with arrivals.arrived(), arrivals.arrived():
        assert 0.03 <= arrivals.expected_delay_s() <= 0.4  # two ahead at the same pace


def test_a_request_knows_how_long_ago_it_arrived() -> None:
    arrivals = Arrivals()
    assert arrivals.waited_s() == 0.0  # not counted here
    with arrivals.arrived():
        time.sleep(0.05)
        assert 0.05 <= arrivals.waited_s() < 2.0


async def test_a_settled_burst_goes_on_a_few_requests_per_event_loop_pass() -> None:
    arrivals, passes, released = Arrivals(), [0], []

    async def count_passes() -> None:
        while True:
            passes[0] += 1
            await asyncio.sleep(0)

    async def request(index: int) -> None:
        with arrivals.arrived():
            await arrivals.settled()
            released.append((index, passes[0]))

    counter = asyncio.ensure_future(count_passes())
    await asyncio.gather(*(request(index) for index in range(2 * RELEASE_PER_PASS + 3)))
    counter.cancel()
    by_pass = [when for _, when in sorted(released)]
    assert [index for index, _ in released] == sorted(index for index, _ in released)  # in arrival order
    groups = [by_pass[start : start + RELEASE_PER_PASS] for start in range(0, len(by_pass), RELEASE_PER_PASS)]
    assert all(len(set(group)) == 1 for group in groups)  # each group in one pass
    assert [group[0] for group in groups] == sorted({group[0] for group in groups})  # each in a later one
