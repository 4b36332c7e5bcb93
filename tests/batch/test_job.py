"""Batch jobs on a real RQ ``BatchWorker`` and a real Redis (one, and a Redis Cluster with RQ's Redis
beside it): a batch whose input vanished fails at once (one run, no retry storm), a runner that fails for
good ends its batch, and a cancel then ends it; a runner with nothing to do stops at once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from rq.job import Job, JobStatus

from metrale.batch.job import COMMAND_POLL_S, BatchWorker
from metrale.batch.runner import BatchRun
from metrale.gateway.batches.job_queue import RUNS_PER_JOB, BatchJobQueue
from metrale.shared.settings import BatchRunnerSettings
from tests.batch.test_runner import KEYS, A, chat_line, jsonl, submit
from tests.gateway.harness import Harness, gateway_harness
from tests.redis_kinds import HarnessRedis

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def batch_worker(h: Harness, where: HarnessRedis) -> AsyncIterator[BatchWorker]:
    """A ``BatchWorker`` on the harness's queue (RQ on ``where.jobs_url``, the fleet on ``where.url``);
    its loop and gateway closed after."""
    gateway = dataclasses.replace(h.settings, redis_url=where.url, jobs_redis_url=where.jobs_url)
    worker = BatchWorker(BatchRunnerSettings(gateway=gateway, lease_s=2), redis.Redis.from_url(str(where.jobs_url)))
    try:
        yield worker
    finally:
        await asyncio.to_thread(worker.loop.close)  # it runs its own loop: not from inside this one
        worker.connection.close()


def batch_harness(where: HarnessRedis, files_dir: Path) -> contextlib.AbstractAsyncContextManager[Harness]:
    """The gateway harness on ``where`` with a file store, as the batch tests use it."""
    return gateway_harness(api_keys=KEYS, files_dir=files_dir, redis_url=where.url, jobs_redis_url=where.jobs_url)


async def drain(worker: BatchWorker) -> None:
    """Run every queued batch job (and its retries) until the queue is empty."""
    await asyncio.to_thread(worker.work, burst=True, logging_level="WARNING")


async def work_once(h: Harness, where: HarnessRedis) -> None:
    """Drain the queue with a new ``BatchWorker``."""
    async with batch_worker(h, where) as worker:
        await drain(worker)


def job_of(h: Harness, batch_id: str) -> Job:
    jobs = BatchJobQueue(h.jobs, h.keys)
    return Job.fetch(jobs.job_id(batch_id), connection=h.jobs)


async def test_a_batch_whose_input_vanished_fails_at_once(fleet_redis: HarnessRedis, tmp_path: Path) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=fleet_redis.url, jobs_redis_url=fleet_redis.jobs_url
    ) as h:
        batch_id = await submit(h, jsonl([chat_line("a", "hi")]))
        input_id = (await h.http.get(f"/v1/batches/{batch_id}", headers=A)).json()["input_file_id"]
        (tmp_path / "tenant-a" / input_id).unlink()  # the bytes gone behind the API's back
        await work_once(h, fleet_redis)
        batch = (await h.http.get(f"/v1/batches/{batch_id}", headers=A)).json()
        assert batch["status"] == "failed" and batch["failed_at"]
        assert batch["errors"]["object"] == "list"
        assert [error["code"] for error in batch["errors"]["data"]] == ["input_file_missing"]
        assert input_id in batch["errors"]["data"][0]["message"]
        job = job_of(h, batch_id)
        assert job.get_status() is JobStatus.FINISHED and job.retries_left == RUNS_PER_JOB  # ran once
        assert await h.redis.zcard(h.keys.active_batches()) == 0


async def test_a_runner_that_fails_for_another_reason_fails_the_batch_in_one_run(
    fleet_redis: HarnessRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: BatchRun) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(BatchRun, "run", broken)
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=fleet_redis.url, jobs_redis_url=fleet_redis.jobs_url
    ) as h:
        batch_id = await submit(h, jsonl([chat_line("a", "hi")]))
        await work_once(h, fleet_redis)
        batch = (await h.http.get(f"/v1/batches/{batch_id}", headers=A)).json()
        assert batch["status"] == "failed"
        assert batch["errors"]["data"][0]["code"] == "batch_runner_failed"
        assert "RuntimeError: a bug" in batch["errors"]["data"][0]["message"]
        assert job_of(h, batch_id).retries_left == RUNS_PER_JOB


async def test_a_job_failing_every_run_ends_its_batch_and_a_cancel_ends_it_cancelled(
    fleet_redis: HarnessRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis errors are retried (a runner or Redis restarting); once RQ gives up, the batch ends."""
    runs = 0

    async def redis_away(self: BatchRun) -> None:
        nonlocal runs
        runs += 1
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr(BatchRun, "run", redis_away)
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=fleet_redis.url, jobs_redis_url=fleet_redis.jobs_url
    ) as h:
        failing = await submit(h, jsonl([chat_line("a", "hi")]))
        await work_once(h, fleet_redis)
        assert runs == RUNS_PER_JOB + 1
        assert job_of(h, failing).get_status() is JobStatus.FAILED
        batch = (await h.http.get(f"/v1/batches/{failing}", headers=A)).json()
        assert batch["status"] == "failed"
        assert batch["errors"]["data"][0]["code"] == "batch_runner_failed"
        assert "ConnectionError" in batch["errors"]["data"][0]["message"]

        cancelled = await submit(h, jsonl([chat_line("b", "hi")]))
        # cancelling while the job is queued, then a runner: the batch is cancelled, the job never runs
        answer = await h.http.post(f"/v1/batches/{cancelled}/cancel", headers=A)
        assert answer.json()["status"] == "cancelled"
        await work_once(h, fleet_redis)
        assert runs == RUNS_PER_JOB + 1
        assert json.loads((await h.http.get(f"/v1/batches/{cancelled}", headers=A)).text)["status"] == "cancelled"


async def test_a_runner_with_nothing_to_do_stops_within_its_command_poll(
    fleet_redis: HarnessRedis, tmp_path: Path
) -> None:
    """A burst runner on an empty queue subscribes to RQ's commands, finds no job and stops; its stop
    waits for the command listener's poll at most (RQ's 60 s poll held some stops a minute)."""
    async with batch_harness(fleet_redis, tmp_path) as h, batch_worker(h, fleet_redis) as worker:
        for _ in range(12):
            began = time.monotonic()
            await drain(worker)
            assert time.monotonic() - began < 2 * COMMAND_POLL_S + 5
