"""``/v1/batches`` state edges: a cancel always ends in ``cancelled`` when no runner runs the job, the
input of an unfinished batch cannot be deleted (409), and metadata within OpenAI's limits."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from metrale.gateway.batches.job_queue import BatchJobQueue
from tests.batch.test_runner import KEYS, A, chat_line, jsonl, submit
from tests.gateway.harness import Harness, gateway_harness
from tests.redis_kinds import HarnessRedis

pytestmark = pytest.mark.anyio


def job_of(h: Harness, batch_id: str) -> Job:
    return Job.fetch(BatchJobQueue(h.jobs, h.keys).job_id(batch_id), connection=h.jobs)


def started(h: Harness, job: Job, *, lease_ends_in_s: float) -> None:
    """As if a runner had taken the job, with its lease ending ``lease_ends_in_s`` from now."""
    job.set_status(JobStatus.STARTED)
    registry = StartedJobRegistry(queue=BatchJobQueue(h.jobs, h.keys).queue)
    h.jobs.zadd(registry.key, {f"{job.id}:execution-1": time.time() + lease_ends_in_s})


@pytest.mark.parametrize("job_state", ["queued", "failed", "gone", "runner-died"])
async def test_a_cancel_of_a_batch_no_runner_runs_ends_cancelled(
    harness_redis: HarnessRedis, tmp_path: Path, job_state: str
) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        batch_id = await submit(h, jsonl([chat_line("a", "hi")]))
        job = job_of(h, batch_id)
        if job_state == "failed":
            job.set_status(JobStatus.FAILED)
        elif job_state == "gone":
            job.delete()
        elif job_state == "runner-died":
            started(h, job, lease_ends_in_s=-5)
        answer = await h.http.post(f"/v1/batches/{batch_id}/cancel", headers=A)
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "cancelled" and answer.json()["cancelled_at"]
        assert await h.redis.zcard(h.keys.active_batches()) == 0
        again = await h.http.post(f"/v1/batches/{batch_id}/cancel", headers=A)
        assert again.json()["status"] == "cancelled"


async def test_a_cancel_of_a_running_batch_waits_for_its_runner(harness_redis: HarnessRedis, tmp_path: Path) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        batch_id = await submit(h, jsonl([chat_line("a", "hi")]))
        started(h, job_of(h, batch_id), lease_ends_in_s=10)
        answer = await h.http.post(f"/v1/batches/{batch_id}/cancel", headers=A)
        assert answer.json()["status"] == "cancelling"  # its runner stops its lines and writes what finished


async def test_the_input_of_an_unfinished_batch_cannot_be_deleted(harness_redis: HarnessRedis, tmp_path: Path) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        batch_id = await submit(h, jsonl([chat_line("a", "hi")]))
        input_id = (await h.http.get(f"/v1/batches/{batch_id}", headers=A)).json()["input_file_id"]
        refused = await h.http.delete(f"/v1/files/{input_id}", headers=A)
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "conflict" and batch_id in refused.json()["error"]["message"]
        assert (tmp_path / "tenant-a" / input_id).exists()
        assert (await h.http.post(f"/v1/batches/{batch_id}/cancel", headers=A)).json()["status"] == "cancelled"
        deleted = await h.http.delete(f"/v1/files/{input_id}", headers=A)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True


def create_body(file_id: str, metadata: object) -> dict[str, object]:
    return {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": metadata,
    }


@pytest.mark.parametrize(
    ("metadata", "named"),
    [
        ({f"k{i}": "v" for i in range(17)}, "16"),
        ({"k" * 65: "v"}, "64"),
        ({"k": "v" * 513}, "512"),
        ({"k": "v" * 7_000_000}, "512"),
    ],
    ids=["17-pairs", "65-char-key", "513-char-value", "7MB-value"],
)
async def test_batch_metadata_past_openais_limits_is_refused(
    harness_redis: HarnessRedis, tmp_path: Path, metadata: object, named: str
) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        files = {"file": ("in.jsonl", jsonl([chat_line("a", "hi")]), "application/jsonl")}
        file_id = (await h.http.post("/v1/files", headers=A, files=files, data={"purpose": "batch"})).json()["id"]
        refused = await h.http.post("/v1/batches", headers=A, json=create_body(file_id, metadata))
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"].startswith("metadata") and named in refused.json()["error"]["message"]
        assert (await h.http.get("/v1/batches", headers=A)).json()["data"] == []
        limit = {f"k{i:02}" + "k" * 61: "v" * 512 for i in range(16)}
        kept = await h.http.post("/v1/batches", headers=A, json=create_body(file_id, limit))
        assert kept.status_code == 200 and kept.json()["metadata"] == limit
