"""A read of the streams never overlaps one of this gateway's submissions, so it counts each of them
exactly once (in the read or in ``UnseenAdmissions``)."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest
from redis.asyncio.client import Pipeline

from metrale.gateway.fleet.dispatcher import Dispatcher
from metrale.gateway.fleet.reads_between_writes import ReadsBetweenWrites
from metrale.shared.keys import Keys
from metrale.shared.messages import GenerateRequest, Priority

pytestmark = pytest.mark.anyio


async def test_a_read_waits_for_the_writes_in_flight_and_holds_new_ones_back() -> None:
    gate = ReadsBetweenWrites()
    log: list[str] = []
    release_write = asyncio.Event()
    release_read = asyncio.Event()

    async def write(name: str, release: asyncio.Event | None) -> None:
        async with gate.writing():
            log.append(f"{name} begins")
            if release is not None:
                await release.wait()
            log.append(f"{name} ends")

    async def read() -> None:
        async with gate.reading():
            log.append("read begins")
            await release_read.wait()
            log.append("read ends")

    first = asyncio.create_task(write("w1", release_write))
    await asyncio.sleep(0)
    reading = asyncio.create_task(read())
    await asyncio.sleep(0)
    second = asyncio.create_task(write("w2", None))
    for _ in range(3):
        await asyncio.sleep(0)
    assert log == ["w1 begins"]  # the read waits for w1; w2 waits for the read
    release_write.set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert log == ["w1 begins", "w1 ends", "read begins"]
    release_read.set()
    await asyncio.gather(first, reading, second)
    assert log == ["w1 begins", "w1 ends", "read begins", "read ends", "w2 begins", "w2 ends"]


async def test_writes_run_beside_each_other() -> None:
    gate = ReadsBetweenWrites()
    inside = 0
    most = 0

    async def write() -> None:
        nonlocal inside, most
        async with gate.writing():
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    await asyncio.gather(*(write() for _ in range(5)))
    assert most == 5


async def test_backlogs_read_during_a_burst_of_submissions_count_each_request_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admit and submit requests while reads run between them, each command taking a few event-loop
    passes to reach Redis and as many to come back: no backlog counts more requests than were admitted
    (a read overlapping an ``XADD`` would see it on the stream and still count it unseen)."""
    execute = Pipeline.execute

    async def in_flight_both_ways(self: Pipeline, raise_on_error: bool = True) -> list[Any]:
        for _ in range(3):
            await asyncio.sleep(0)
        replies = await execute(self, raise_on_error)
        for _ in range(3):
            await asyncio.sleep(0)
        return replies

    monkeypatch.setattr(Pipeline, "execute", in_flight_both_ways)
    client = fakeredis.FakeAsyncRedis()
    dispatcher = Dispatcher(client, Keys("t-reads"))
    seen: list[tuple[int, int]] = []
    admitted = 0

    async def admit_and_submit(index: int) -> None:
        nonlocal admitted
        for _ in range(index):  # arrivals spread over the reads
            await asyncio.sleep(0)
        request_id = f"r{index}"
        dispatcher.unseen.admit(request_id, Priority.INTERACTIVE)
        admitted += 1
        await asyncio.sleep(0)
        await dispatcher.submit(GenerateRequest(request_id, "m", "t", [1, 2], 4))

    async def observe() -> None:
        for _ in range(40):
            backlog = await dispatcher.backlog(Priority.INTERACTIVE)
            seen.append((backlog.in_system, admitted))  # counts what was admitted by its end
            await asyncio.sleep(0)

    await asyncio.gather(observe(), *(admit_and_submit(index) for index in range(30)))
    final = await dispatcher.backlog(Priority.INTERACTIVE)
    assert final.in_system == 30
    assert all(in_system <= admitted_then for in_system, admitted_then in seen), seen
    assert any(0 < in_system < 30 for in_system, _ in seen)  # reads did run amid the submissions
    await client.aclose()
