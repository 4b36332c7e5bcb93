"""Real processes on a real Redis: a worker stopped with SIGTERM hands its streams to another at once (on a
Redis Cluster too),
a Redis restarted empty mid-stream costs no client more than a clear error, and ``met fleet up``
starts and stops a whole local fleet."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from metrale.shared.record import read_record
from metrale.shared.redis_connect import connect_sync
from metrale.worker.engine.factory import LoadedModel
from tests.failover.clients import Streamed, event_tap, stream_all
from tests.failover.local_fleet import LocalFleet, completion_body, reference_tokens, text_of
from tests.failover.processes import MET, RedisServer, children, free_port, met_environment, ready, spawn

pytestmark = pytest.mark.slow

PROMPT = list(range(60, 76))


@pytest.fixture
def fleet(redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalFleet]:
    fleet = LocalFleet(redis_server.url, tiny_model_dir, tmp_path, MET_REQUEST_TIMEOUT_S="45")
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def any_fleet(fleet_redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalFleet]:
    """``fleet`` on a private Redis, or on a private Redis Cluster."""
    fleet = LocalFleet(fleet_redis_url, tiny_model_dir, tmp_path, MET_REQUEST_TIMEOUT_S="45")
    try:
        yield fleet
    finally:
        fleet.close()


def prompts(count: int) -> list[list[int]]:
    return [[token + i for token in PROMPT] for i in range(count)]


def assert_exact(model: LoadedModel, fleet: LocalFleet, url: str, bodies: list[dict], streams: list[Streamed]) -> None:
    """Every stream finished with the tokens of an undisturbed run with the seed it was served with."""
    client = connect_sync(url)
    records = [read_record(client, str(s.request_id), keys=fleet.keys) for s in streams]
    seeds = [r.seed if r is not None and r.seed is not None else -1 for r in records]
    for stream, body, tokens in zip(streams, bodies, reference_tokens(model, bodies, seeds), strict=True):
        assert (stream.done, stream.errors, stream.finish_reasons) == (True, [], ["length"])
        assert stream.text == text_of(model, body["prompt"], tokens), stream.request_id


def test_sigterm_hands_a_workers_streams_to_another_at_once(
    any_fleet: LocalFleet, fleet_redis_url: str, reference_model: LoadedModel
) -> None:
    fleet = any_fleet
    fleet.start(["worker-1", "worker-2"])
    bodies = [completion_body(i, p, max_tokens=48, seeded=i % 2 == 0) for i, p in enumerate(prompts(24))]
    tap = event_tap(fleet_redis_url, fleet.keys)
    stopped: dict[str, float] = {}

    def stop_busiest() -> None:
        while tap.tokens_heard() < len(bodies) * 8:
            time.sleep(0.01)
        owners = Counter(events[-1].worker_id for events in tap.snapshot().values() if not events[-1].finished)
        name = owners.most_common(1)[0][0]
        started = time.monotonic()
        fleet.workers[name].signal(signal.SIGTERM)
        fleet.workers[name].popen.wait(30)
        stopped[name] = time.monotonic() - started

    stopper = threading.Thread(target=stop_busiest, daemon=True)
    stopper.start()
    streams = asyncio.run(stream_all(fleet.base_url, bodies, 120))
    stopper.join(30)
    tap.close()

    ((name, exit_s),) = stopped.items()
    assert fleet.workers[name].popen.returncode == 0
    assert exit_s < 10, f"{name} took {exit_s:.1f} s to hand back and exit"
    assert_exact(reference_model, fleet, fleet_redis_url, bodies, streams)
    moved = sum(len({e.worker_id for e in events}) > 1 for events in tap.snapshot().values())
    assert moved >= 1
    assert fleet.metric("metrale_handed_back_requests_total") >= moved


def test_a_redis_restarted_empty_mid_stream_leaves_no_client_waiting(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path, reference_model: LoadedModel
) -> None:
    """The running requests finish exactly; those still queued (lost with the restart) end with a
    clear error long before their deadline."""
    fleet = LocalFleet(redis_server.url, tiny_model_dir, tmp_path, max_seqs=8, MET_REQUEST_TIMEOUT_S="60")
    try:
        fleet.start(["worker-1"])
        streams, bodies = restart_redis_while_streaming(fleet, redis_server, 12, running=8)
        (after,) = asyncio.run(stream_all(fleet.base_url, [completion_body(99, PROMPT, max_tokens=8, seeded=True)], 60))
    finally:
        fleet.close()

    finished = [(s, b) for s, b in zip(streams, bodies, strict=True) if s.finish_reasons == ["length"]]
    lost = [s for s in streams if s.errors]
    assert (len(finished), len(lost)) == (8, 4), streams
    assert all("was lost" in str(error) for s in lost for error in s.errors), lost
    for stream, body in finished:
        (tokens,) = reference_tokens(reference_model, [body], [body["seed"]])
        assert stream.text == text_of(reference_model, body["prompt"], tokens)
    assert after.finish_reasons == ["length"], after  # the fleet serves again


def restart_redis_while_streaming(
    fleet: LocalFleet, server: RedisServer, count: int, running: int
) -> tuple[list[Streamed], list[dict]]:
    """Stream ``count`` seeded requests; once ``running`` of them have streamed a few tokens, stop
    Redis and start it again, empty. Every stream must end before its deadline."""
    bodies = [completion_body(i, p, max_tokens=64, seeded=True) for i, p in enumerate(prompts(count))]

    def restart() -> None:
        client = redis.Redis.from_url(server.url)
        records = f"{fleet.keys.namespace}:run:*:events"
        while sum(client.llen(key) >= 8 for key in client.scan_iter(match=records)) < running:
            time.sleep(0.05)
        client.close()
        server.stop()
        time.sleep(1.0)
        server.start()

    restarter = threading.Thread(target=restart, daemon=True)
    restarter.start()
    started = time.monotonic()
    streams = asyncio.run(stream_all(fleet.base_url, bodies, 75))
    restarter.join(30)
    assert time.monotonic() - started < 60, "a stream outlived its deadline"
    return streams, bodies


def test_fleet_up_serves_and_ctrl_c_stops_every_process(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    environment = met_environment({"MET_CACHE_DIR": str(tmp_path / "cache"), "MET_NAMESPACE": "met-fleet-up"})
    command = [str(MET), "fleet", "up", "--workers", "2", "--redis", redis_server.url, "--port", str(port)]
    fleet = spawn("fleet", [*command, "--model", str(tiny_model_dir)], environment, tmp_path)
    try:
        base_url = f"http://127.0.0.1:{port}"
        fleet.wait_until(lambda: ready(base_url), "the fleet's gateway")
        model = tiny_model_dir.resolve().name
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text

        members = children(fleet.popen.pid)
        assert len(members) == 3  # a gateway and two workers

        fleet.signal(signal.SIGINT)
        assert fleet.popen.wait(60) == 0, fleet.log_tail()
    finally:
        if fleet.running:
            fleet.popen.kill()
    assert not ready(base_url)
    assert [pid for pid in members if Path(f"/proc/{pid}").exists()] == [], "members outlived Ctrl-C"
