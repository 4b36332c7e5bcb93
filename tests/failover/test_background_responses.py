"""A background response on a fleet of real processes (a private ``redis-server``, a gateway, two
workers, ``met batch-runner``): its client leaves mid-stream, the worker running it is killed with
SIGKILL and the gateway is restarted while it runs; it completes, ``retrieve`` shows it completed, and
its stream resumed with ``starting_after`` continues with no gap or duplicate: the deltas add up to an
undisturbed run's (greedy)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from metrale.shared.record import read_record
from metrale.shared.settings import DEFAULT_TENANT
from tests.failover.local_fleet import DECODE_INTERVAL, MODEL, LocalFleet
from tests.failover.processes import MET, Process, RedisServer, ready, spawn

pytestmark = pytest.mark.slow

OUTPUT_TOKENS = 160
KILL_AT_TOKENS = 2 * DECODE_INTERVAL
WAIT_S = 240.0
BODY = {
    "model": MODEL,
    "input": "Tell the story of the lighthouse keeper.",
    "max_output_tokens": OUTPUT_TOKENS,
    "temperature": 0.0,
    "ignore_eos": True,
    "background": True,
}


@pytest.fixture
def fleet(redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalFleet]:
    fleet = LocalFleet(redis_server.url, tiny_model_dir, tmp_path, max_seqs=4, MET_BATCH_LEASE_S="3")
    runner: Process | None = None
    try:
        fleet.start(["worker-1", "worker-2"])
        command = [str(MET), "batch-runner", "--redis", redis_server.url]
        runner = spawn("batch-runner", command, fleet.environment, tmp_path)
        yield fleet
    finally:
        if runner is not None:
            runner.stop()
        fleet.close()


def events_of(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))


def deltas(events: list[dict[str, Any]]) -> str:
    return "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")


def completed(http: httpx.Client, response_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while (body := http.get(f"/v1/responses/{response_id}").json())["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
    return body


def stop_gateway(fleet: LocalFleet) -> None:
    assert fleet.gateway is not None
    fleet.gateway.stop()


def start_gateway(fleet: LocalFleet) -> None:
    command = [str(MET), "gateway", "--redis", fleet.redis_url, "--port", str(fleet.port)]
    fleet.gateway = spawn("gateway-2", command, fleet.environment, fleet.log_dir)
    fleet.gateway.wait_until(lambda: ready(fleet.base_url), "the restarted gateway to be ready")


def test_a_background_response_survives_its_worker_its_gateway_and_its_client(
    fleet: LocalFleet, redis_server: RedisServer
) -> None:
    store = redis.Redis.from_url(redis_server.url)
    try:
        with httpx.Client(base_url=fleet.base_url, timeout=120) as http:
            undisturbed = completed(http, http.post("/v1/responses", json=BODY).json()["id"])
            assert undisturbed["status"] == "incomplete"  # it ran to max_output_tokens
            expected = undisturbed["output"][0]["content"][0]["text"]

            seen: list[dict[str, Any]] = []
            victim = None
            with http.stream("POST", "/v1/responses", json={**BODY, "stream": True}) as streamed:
                assert streamed.status_code == 200
                for event in events_of(streamed):
                    seen.append(event)
                    record = read_record(store, seen[0]["response"]["id"], keys=fleet.keys)
                    if record is not None and len(record.token_ids()) >= KILL_AT_TOKENS and record.worker_id:
                        victim = record.worker_id
                        fleet.kill(victim)
                        break  # and the client leaves
            assert victim is not None, f"it ended before it could be interrupted\n{fleet.logs()}"
            response_id = seen[0]["response"]["id"]
            stop_gateway(fleet)
            status = store.hget(fleet.keys.response(DEFAULT_TENANT, response_id), "status")
            assert status == b"in_progress"  # the gateway went while it ran (its worker dead too)
            start_gateway(fleet)

        with httpx.Client(base_url=fleet.base_url, timeout=120) as http:
            after = seen[-1]["sequence_number"]
            params = {"stream": "true", "starting_after": after}
            with http.stream("GET", f"/v1/responses/{response_id}", params=params) as resumed:
                assert resumed.status_code == 200
                rest = list(events_of(resumed))
            events = seen + rest
            assert [event["sequence_number"] for event in events] == list(range(len(events)))
            assert rest[-1]["type"] == "response.incomplete"
            assert deltas(events) == expected
            retrieved = http.get(f"/v1/responses/{response_id}").json()
            assert retrieved["status"] == "incomplete" and retrieved["output"] == rest[-1]["response"]["output"]
            assert retrieved["output"][0]["content"][0]["text"] == expected

        record = read_record(store, response_id, keys=fleet.keys)
        assert record is not None and len({event.worker_id for event in record.events}) > 1  # it moved
        assert record.events[0].worker_id == victim
    except BaseException:
        print(fleet.logs())
        raise
    finally:
        store.close()
