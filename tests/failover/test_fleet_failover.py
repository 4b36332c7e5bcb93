"""Real processes on a real Redis: one gateway, three workers, a hundred concurrent streams, and one
worker killed with SIGKILL mid-run. Every stream completes with exactly the tokens of an undisturbed
run, each ``seq`` published exactly once, and the gateway's metrics show how little was prefilled again."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from metrale.shared.record import read_record
from metrale.worker.engine.factory import LoadedModel
from tests.failover.clients import EventTap, delivered, kill_busiest_worker_when, stream_all
from tests.failover.local_fleet import (
    DECODE_INTERVAL,
    LocalFleet,
    completion_body,
    reference_tokens,
    text_of,
)
from tests.failover.processes import RedisServer

pytestmark = pytest.mark.slow

REQUESTS = 100
PROMPT_TOKENS = 16
MAX_TOKENS = 32
KILL_AFTER_SHARE = 0.3
"""The kill comes once this share of all tokens has been streamed."""
STREAMS_TIMEOUT_S = 150


@pytest.fixture
def fleet(redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalFleet]:
    fleet = LocalFleet(redis_server.url, tiny_model_dir, tmp_path)
    try:
        yield fleet
    finally:
        fleet.close()


def test_a_worker_killed_mid_run_loses_no_stream_and_changes_no_token(
    fleet: LocalFleet, redis_server: RedisServer, reference_model: LoadedModel
) -> None:
    fleet.start(["worker-1", "worker-2", "worker-3"])
    rng = random.Random(6)
    prompts = [[rng.randrange(20, 500) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]
    bodies = [completion_body(i, p, max_tokens=MAX_TOKENS, seeded=i % 2 == 0) for i, p in enumerate(prompts)]
    tap = EventTap(redis_server.url, fleet.keys)
    killer = kill_busiest_worker_when(tap, int(REQUESTS * MAX_TOKENS * KILL_AFTER_SHARE), fleet)

    streams = asyncio.run(stream_all(fleet.base_url, bodies, STREAMS_TIMEOUT_S))

    killer.join(1)
    tap.close()
    killed = [name for name, worker in fleet.workers.items() if not worker.running]
    assert len(killed) == 1, fleet.logs()
    assert all(s.done and not s.errors and s.finish_reasons == ["length"] for s in streams), [
        s for s in streams if s.errors
    ][:3]
    client = redis.Redis.from_url(redis_server.url)
    records = [read_record(client, str(s.request_id), keys=fleet.keys) for s in streams]
    seeds = [record.seed if record is not None else -1 for record in records]
    expected = reference_tokens(reference_model, bodies, seeds)
    heard = tap.snapshot()
    continued, different = 0, []
    for stream, body, tokens in zip(streams, bodies, expected, strict=True):
        events = delivered(heard[str(stream.request_id)])
        streamed = [t for e in events for t in e.token_ids]
        moved = len({e.worker_id for e in events}) > 1
        if streamed != tokens or stream.text != text_of(reference_model, body["prompt"], tokens):
            first = next(i for i, (a, b) in enumerate(zip(streamed, tokens, strict=False)) if a != b)
            switch = next((e.seq for e in events if e.worker_id != events[0].worker_id), None)
            different.append(f"{stream.request_id}: token {first} differs; moved at seq {switch}")
        continued += moved
    assert not different, different
    assert continued >= 1
    resumed = wait_for_metric(fleet, "metrale_resumed_requests_total", at_least=continued)
    prefilled = fleet.metric("metrale_resume_prefill_tokens_total")
    assert prefilled <= resumed * 3 * DECODE_INTERVAL  # bounded by the checkpoint interval ...
    assert prefilled < resumed * (PROMPT_TOKENS + MAX_TOKENS / 2)  # ... not by the context
    # Checkpoints are stored by a background writer while events already flow, so a request whose worker
    # dies right after its prompt may find none yet and is fed again from 0 (bounded above). Idle, about
    # three in four resume from one; on a starved machine (CI's 2 cores) the writer lags and fewer than half
    # did (336 of 768 prompt tokens), so the bound asks for a quarter.
    wait_for_metric(fleet, "metrale_resume_checkpoint_tokens_total", at_least=0.25 * continued * PROMPT_TOKENS)


def wait_for_metric(fleet: LocalFleet, name: str, at_least: float, timeout_s: float = 20.0) -> float:
    """Poll the gateway's metric until it reaches ``at_least`` (workers push counters as they beat)."""
    deadline = time.monotonic() + timeout_s
    while (value := fleet.metric(name)) < at_least:
        assert time.monotonic() < deadline, f"{name} is {value}, expected at least {at_least}"
        time.sleep(0.2)
    return value
