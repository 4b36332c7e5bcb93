"""The connection cap's choices: which connection makes room, when a new one is refused, and the log."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import pytest

from metrale.gateway.edge.connection_guard import ConnectionEvents, ConnectionGuard

pytestmark = pytest.mark.anyio  # the guard runs on the server's event loop (its log flushes there)


@dataclass(eq=False)
class FakeConnection:
    name: str
    evicted: bool = False

    def evict(self) -> None:
        self.evicted = True


def opened(guard: ConnectionGuard, *names: str) -> list[FakeConnection]:
    connections = [FakeConnection(name) for name in names]
    for connection in connections:
        assert guard.opened(connection)
    return connections


async def test_at_the_cap_the_oldest_that_never_sent_a_request_makes_room() -> None:
    guard = ConnectionGuard(3)
    a, b, c = opened(guard, "a", "b", "c")
    guard.in_request(a)
    newcomer = FakeConnection("new")
    assert guard.opened(newcomer)
    assert [x.evicted for x in (a, b, c)] == [False, True, False]
    assert guard.open_count == 3


async def test_idle_keep_alive_connections_go_after_those_never_served() -> None:
    guard = ConnectionGuard(3)
    a, b, c = opened(guard, "a", "b", "c")
    for connection in (a, b):
        guard.in_request(connection)
    guard.idle(a)  # served, waiting on keep-alive
    assert guard.opened(FakeConnection("d"))
    assert c.evicted and not a.evicted
    assert guard.opened(FakeConnection("e"))  # "d" is unserved and newest; "a" idle is older but served second
    assert [x.name for x in (a, b, c) if x.evicted] == ["c"]


async def test_when_every_connection_is_in_a_request_the_new_one_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    guard = ConnectionGuard(2)
    for connection in opened(guard, "a", "b"):
        guard.in_request(connection)
    with caplog.at_level(logging.WARNING, "metrale.gateway.connections"):
        assert not guard.opened(FakeConnection("c"))
    assert guard.open_count == 2
    assert ["1 refused (every connection in a request)" in r.getMessage() for r in caplog.records] == [True]


async def test_a_closed_connection_frees_its_place() -> None:
    guard = ConnectionGuard(1)
    (a,) = opened(guard, "a")
    guard.in_request(a)
    guard.closed(a)
    assert guard.opened(FakeConnection("b"))
    assert not a.evicted


async def test_events_are_logged_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    events = ConnectionEvents(lambda: now[0], every_s=0.05)
    with caplog.at_level(logging.WARNING, "metrale.gateway.connections"):
        events.note("headers timeout")  # the first at once
        for _ in range(500):
            events.note("evicted (connection cap)")
        events.note("headers timeout")
        assert len(caplog.records) == 1
        now[0] += 0.05
        await asyncio.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "HTTP connections closed: 1 headers timeout",
        "HTTP connections closed in 0 s: 500 evicted (connection cap), 1 headers timeout",
    ]
