"""A batch runner's memory per batch: one gateway for all its jobs (each job built its own, and the
runner's RSS grew 20-30 KiB per batch), and the Python allocations a batch leaves behind bounded."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest

from metrale.batch.job import BatchWorker
from metrale.gateway.state import Gateway
from tests.batch.test_job import batch_worker, drain
from tests.batch.test_runner import KEYS, chat_line, jsonl, submit
from tests.gateway.harness import Harness, gateway_harness
from tests.redis_kinds import HarnessRedis

pytestmark = pytest.mark.anyio

WARM_UP = 10
MEASURED = 50
RETAINED_PER_BATCH = 4096
"""Bytes of Python allocations a finished batch may leave (1-3.5 KiB measured: RQ's and redis-py's small
caches). The fake worker's record of what it received is the harness's, and is emptied."""
TRACED_FRAMES = 4
"""Enough to see the registry below the decoder that allocates for it."""
NOT_PER_BATCH = [tracemalloc.Filter(False, "*/metrale/gateway/fleet/registry.py", all_frames=True)]
"""Left out of the count: the model registry re-reads the model's announcement on a timer (a ~20 KiB
payload held until the next read), whichever batch it lands beside."""


async def run_batches(h: Harness, worker: BatchWorker, count: int) -> None:
    for i in range(count):
        await submit(h, jsonl([chat_line(f"req-{i}", "hi")]))
    await drain(worker)
    h.worker.requests.clear()
    h.worker.cancels.clear()


async def test_a_runner_builds_one_gateway_and_keeps_little_per_batch(
    fleet_redis: HarnessRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = 0
    build = Gateway.build

    def counting(*args: object, **kwargs: object) -> Gateway:
        nonlocal built
        built += 1
        return build(*args, **kwargs)  # type: ignore[arg-type]

    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=fleet_redis.url, jobs_redis_url=fleet_redis.jobs_url
    ) as h:
        monkeypatch.setattr(Gateway, "build", counting)
        async with batch_worker(h, fleet_redis) as worker:
            await run_batches(h, worker, WARM_UP)
            gc.collect()
            tracemalloc.start(TRACED_FRAMES)
            try:
                before = tracemalloc.take_snapshot()
                await run_batches(h, worker, MEASURED)
                gc.collect()
                after = tracemalloc.take_snapshot()
            finally:
                tracemalloc.stop()
        after, before = after.filter_traces(NOT_PER_BATCH), before.filter_traces(NOT_PER_BATCH)
        retained = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        assert built == 1
        assert retained / MEASURED < RETAINED_PER_BATCH, retained / MEASURED
        listed = (await h.http.get("/v1/batches?limit=100", headers={"Authorization": "Bearer sk-a"})).json()
        assert {batch["status"] for batch in listed["data"]} == {"completed"}
