from __future__ import annotations

import asyncio

import pytest

from metrale.gateway.fleet.shared_read import SharedRead

pytestmark = pytest.mark.anyio


class GatedRead:
    """A read that counts its calls and returns the call number once ``gate`` opens."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate = asyncio.Event()
        self.failure: Exception | None = None

    async def __call__(self) -> int:
        self.calls += 1
        call = self.calls
        await self.gate.wait()
        if self.failure is not None:
            raise self.failure
        return call


async def _started(count: int, shared: SharedRead[int]) -> list[asyncio.Task[int]]:
    callers = [asyncio.create_task(shared()) for _ in range(count)]
    await asyncio.sleep(0)  # every caller has asked
    return callers


async def test_callers_during_a_read_share_it() -> None:
    read = GatedRead()
    shared = SharedRead(read)
    callers = await _started(3, shared)
    read.gate.set()
    assert await asyncio.gather(*callers) == [1, 1, 1]
    assert read.calls == 1


async def test_a_caller_after_the_read_finished_reads_again() -> None:
    read = GatedRead()
    read.gate.set()
    shared = SharedRead(read)
    assert [await shared(), await shared()] == [1, 2]


async def test_a_failed_read_fails_every_caller_and_is_not_kept() -> None:
    read = GatedRead()
    read.failure = ConnectionError("redis went away")
    shared = SharedRead(read)
    callers = await _started(2, shared)
    read.gate.set()
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert [type(result) for result in results] == [ConnectionError, ConnectionError]
    read.failure = None
    assert await shared() == 2


async def test_a_cancelled_caller_leaves_the_read_to_the_others() -> None:
    read = GatedRead()
    shared = SharedRead(read)
    leaving, staying = await _started(2, shared)
    leaving.cancel()
    await asyncio.sleep(0)
    read.gate.set()
    assert await staying == 1
    assert leaving.cancelled()
