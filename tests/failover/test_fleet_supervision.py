"""``met fleet up`` supervises its members: a worker killed with ``kill -9`` is replaced, and SIGTERM
or SIGHUP to ``met fleet up`` stops every process of the fleet (real processes, a real Redis)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from metrale.shared.keys import Keys
from tests.failover.processes import (
    MET,
    Process,
    RedisServer,
    children,
    free_port,
    met_environment,
    ready,
    spawn,
)

NAMESPACE = "met-fleet-sup"
REPLACED_WITHIN_S = 10.0
"""The issue's bound: two live workers again this long after one was killed."""


def start_fleet(redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> tuple[Process, str]:
    port = free_port()
    environment = met_environment({"MET_CACHE_DIR": str(tmp_path / "cache"), "MET_NAMESPACE": NAMESPACE})
    command = [str(MET), "fleet", "up", "--workers", "2", "--redis", redis_server.url, "--port", str(port)]
    fleet = spawn("fleet", [*command, "--model", str(tiny_model_dir)], environment, tmp_path)
    base_url = f"http://127.0.0.1:{port}"
    fleet.wait_until(lambda: ready(base_url), "the fleet's gateway")
    return fleet, base_url


def worker_pids(fleet: Process) -> list[int]:
    """The pids of the fleet's ``met worker`` children."""
    return [pid for pid in children(fleet.popen.pid) if b"worker" in _cmdline(pid)]


def beating_pids(client: redis.Redis) -> set[int]:
    """The pids in the ids of the workers whose heartbeat key exists (ids are ``host-pid-random``)."""
    keys = client.scan_iter(match=Keys(NAMESPACE).worker_pattern(), count=100)
    return {int(key.decode().rsplit("-", 2)[-2]) for key in keys}


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, fleet: Process) -> float:
    """Seconds until ``condition`` held; fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what} not within {timeout_s} s\n{fleet.log_tail()}")
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_killed_worker_is_replaced_and_sigterm_leaves_no_process(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    fleet, base_url = start_fleet(redis_server, tiny_model_dir, tmp_path)
    client = redis.Redis.from_url(redis_server.url)
    try:
        wait_for(lambda: len(worker_pids(fleet)) == 2, 30, "two worker processes", fleet)
        first = worker_pids(fleet)
        wait_for(lambda: set(first) <= beating_pids(client), 60, "both workers beating", fleet)
        members = children(fleet.popen.pid)

        victim = first[0]
        os.kill(victim, signal.SIGKILL)

        def replaced() -> bool:
            now = worker_pids(fleet)
            return len(now) == 2 and victim not in now and set(now) <= beating_pids(client)

        took = wait_for(replaced, REPLACED_WITHIN_S, "a replacement worker beating", fleet)
        assert took < REPLACED_WITHIN_S
        assert "restarted" in fleet.log_tail()
        everyone = set(members) | set(children(fleet.popen.pid))

        fleet.signal(signal.SIGTERM)
        assert fleet.popen.wait(60) == 0, fleet.log_tail()
    finally:
        client.close()
        if fleet.running:
            fleet.popen.kill()
    assert not ready(base_url)
    assert [pid for pid in everyone if _alive(pid)] == [], "members outlived SIGTERM of met fleet up"


def test_sighup_stops_every_process(redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    fleet, base_url = start_fleet(redis_server, tiny_model_dir, tmp_path)
    try:
        members = children(fleet.popen.pid)
        assert len(members) == 3  # a gateway and two workers
        fleet.signal(signal.SIGHUP)
        assert fleet.popen.wait(60) == 0, fleet.log_tail()
    finally:
        if fleet.running:
            fleet.popen.kill()
    assert not ready(base_url)
    assert [pid for pid in members if _alive(pid)] == [], "members outlived SIGHUP of met fleet up"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie already exited: only its parent has not reaped it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
