"""``ReplicaWaiter`` on real servers: a replica confirms a write; without one the writer checks the write
is on the primary (writing it again if not) and stops waiting for a while."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio

from metrale.shared.replication import PAUSE_S, Replication, ReplicaWaiter
from tests.failover.processes import Process, free_port, spawn
from tests.shared.conftest import TEST_REDIS_URL

MARK = "met:replication:mark"


@pytest.fixture
def primary_with_replica(tmp_path: Path) -> Iterator[tuple[redis.Redis, Process]]:
    """A client of a private primary whose one replica has finished its first sync, and the replica."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("this test starts its own redis-server, and none is installed")
    ports = free_port(), free_port()
    processes: list[Process] = []
    args = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    args += ["--repl-diskless-sync-delay", "0"]  # the first sync at once, not after 5 s
    processes.append(spawn("primary", [binary, "--port", str(ports[0]), *args], os.environ, tmp_path))
    replica_of = ["--replicaof", "127.0.0.1", str(ports[0])]
    processes.append(spawn("replica", [binary, "--port", str(ports[1]), *args, *replica_of], os.environ, tmp_path))
    primary = redis.Redis(port=ports[0], socket_timeout=5)
    replica = redis.Redis(port=ports[1], socket_timeout=5, decode_responses=True)
    processes[1].wait_until(lambda: _linked(replica), "the replica's first sync", timeout_s=20)
    try:
        yield primary, processes[1]
    finally:
        processes[1].signal(signal.SIGCONT)
        primary.close()
        replica.close()
        for process in processes:
            process.stop()


def _linked(replica: redis.Redis) -> bool:
    try:
        return replica.info("replication").get("master_link_status") == "up"
    except redis.ConnectionError:
        return False


def test_a_replica_confirms_a_write(primary_with_replica: tuple[redis.Redis, Process]) -> None:
    primary, _ = primary_with_replica
    waiter = ReplicaWaiter(Replication(replicas=1, timeout_ms=2000), MARK)
    primary.set("met:test", "1")
    checked: list[bool] = []
    assert waiter.confirm(primary, missing=lambda: checked.append(True) or True, write=lambda: None)
    assert not checked and waiter.shortfalls == 0 and waiter.active


def test_a_write_on_another_connection_is_not_confirmed_by_a_stalled_replica(
    primary_with_replica: tuple[redis.Redis, Process],
) -> None:
    primary, replica = primary_with_replica
    waiter = ReplicaWaiter(Replication(replicas=1, timeout_ms=300), MARK)
    _acknowledged_within(waiter, primary, 10.0)  # this client's writes (the mark) are confirmed
    replica.signal(signal.SIGSTOP)  # the replica hears nothing more
    with redis.Redis(port=primary.connection_pool.connection_kwargs["port"]) as other:
        other.set("met:test", "written on another connection")
    assert primary.wait(1, 300) == 1  # a bare WAIT on this connection counts the stalled replica ...
    assert waiter.acknowledgements(primary) == 0  # ... the mark makes it wait for the other connection's write
    replica.signal(signal.SIGCONT)
    _acknowledged_within(waiter, primary, 10.0)


def _acknowledged_within(waiter: ReplicaWaiter, primary: redis.Redis, timeout_s: float) -> None:
    """The replica confirms ``primary``'s writes within ``timeout_s`` (a replica just linked or woken may
    miss one 300 ms ``WAIT`` on a loaded machine before its first acknowledgement)."""
    deadline = time.monotonic() + timeout_s
    while waiter.acknowledgements(primary) != 1:
        assert time.monotonic() < deadline, "the replica never confirmed the writes"


def test_without_a_replica_a_lost_write_is_made_again_then_waits_pause(real_redis: redis.Redis) -> None:
    waiter = ReplicaWaiter(Replication(replicas=1, timeout_ms=50), MARK)
    writes: list[int] = []

    def write() -> None:
        writes.append(1)
        real_redis.set("met:test", "1")

    assert not waiter.confirm(real_redis, missing=lambda: not real_redis.exists("met:test"), write=write)
    assert writes == [1] and real_redis.get("met:test") == b"1"  # found missing: written again
    assert waiter.shortfalls == 1 and not waiter.active
    began = time.monotonic()
    assert not waiter.confirm(real_redis, missing=lambda: pytest.fail("no wait while paused"), write=write)
    assert time.monotonic() - began < 0.05 and writes == [1]


def test_a_write_the_primary_holds_is_not_made_again(real_redis: redis.Redis) -> None:
    waiter = ReplicaWaiter(Replication(replicas=1, timeout_ms=50), MARK)

    async def scenario() -> bool:
        client = redis.asyncio.Redis.from_url(TEST_REDIS_URL)
        await client.set("met:test", "1")

        async def missing() -> bool:
            return not await client.exists("met:test")

        async def write() -> None:
            pytest.fail("the primary holds the write")

        try:
            return await waiter.confirm_async(client, missing=missing, write=write)
        finally:
            await client.aclose()

    assert not asyncio.run(scenario())
    assert waiter.shortfalls == 1 and not waiter.active


def test_no_replicas_asked_means_no_wait(real_redis: redis.Redis) -> None:
    waiter = ReplicaWaiter(Replication(), MARK)
    assert not waiter.active
    assert not waiter.confirm(real_redis, missing=lambda: pytest.fail("no check"), write=lambda: None)


def test_the_pause_ends() -> None:
    waiter = ReplicaWaiter(Replication(replicas=1), MARK)
    waiter._paused_until = time.monotonic() + 0.01
    assert not waiter.active
    time.sleep(0.02)
    assert waiter.active and PAUSE_S >= 0.5


@pytest.mark.parametrize(("replicas", "timeout_ms"), [(-1, 100), (1, 0)])
def test_bad_values_are_refused(replicas: int, timeout_ms: int) -> None:
    with pytest.raises(ValueError, match="redis_wait"):
        Replication(replicas, timeout_ms)
