"""``BatchRun`` in-process on the gateway harness (a fake worker on fakeredis): validation, the output
file against the online endpoint, resuming after a runner died, cancel and expiry."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from metrale.batch.runner import BatchRun
from metrale.gateway.batches.batch_store import BatchStore
from metrale.gateway.batches.job_queue import BatchJobQueue
from metrale.gateway.batches.objects import BatchStatus
from metrale.gateway.fleet.admission import FleetAdmission
from metrale.gateway.state import Gateway
from metrale.shared.errors import QueueFull
from tests.gateway.harness import MODEL, Harness, gateway_harness
from tests.redis_kinds import HarnessRedis

pytestmark = pytest.mark.anyio

KEYS = {"sk-a": "tenant-a"}
A = {"Authorization": "Bearer sk-a"}


def chat_line(custom_id: str, text: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


async def submit(h: Harness, content: bytes, endpoint: str = "/v1/chat/completions") -> str:
    files = {"file": ("in.jsonl", content, "application/jsonl")}
    uploaded = await h.http.post("/v1/files", headers=A, files=files, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    body = {"input_file_id": uploaded.json()["id"], "endpoint": endpoint, "completion_window": "24h"}
    created = await h.http.post("/v1/batches", headers=A, json=body)
    assert created.status_code == 200, created.text
    assert created.json()["status"] == "validating"
    return str(created.json()["id"])


def gateway(h: Harness) -> Gateway:
    found: Gateway = h.app.state.gateway
    return found


async def content(h: Harness, file_id: str) -> list[dict[str, Any]]:
    answer = await h.http.get(f"/v1/files/{file_id}/content", headers=A)
    return [json.loads(line) for line in answer.text.splitlines()]


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in body.items() if name not in ("id", "created")}


async def test_every_line_answered_as_the_online_endpoint_answers(harness_redis: HarnessRedis, tmp_path: Path) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        lines = [chat_line(f"req-{i}", f"hello {i}", seed=i) for i in range(5)]
        batch_id = await submit(h, jsonl(lines))
        assert await h.redis.zrange(h.keys.active_batches(), 0, -1) == [f"tenant-a:{batch_id}".encode()]
        assert await BatchRun(gateway(h), "tenant-a", batch_id, window=2).run() is BatchStatus.COMPLETED
        assert await h.redis.zcard(h.keys.active_batches()) == 0  # a finished batch leaves the active index
        batch = (await h.http.get(f"/v1/batches/{batch_id}", headers=A)).json()
        assert batch["status"] == "completed" and batch["error_file_id"] is None
        assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
        assert all(batch[f"{s}_at"] for s in ("in_progress", "finalizing", "completed"))
        output = await content(h, batch["output_file_id"])
        assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(5)]
        for line, request in zip(output, lines, strict=True):
            online = await h.http.post("/v1/chat/completions", headers=A, json=request["body"])
            assert line["response"]["status_code"] == 200 and line["error"] is None
            assert without_ids(line["response"]["body"]) == without_ids(online.json())
        assert {r.priority for r in h.worker.requests if r.request_id.endswith(tuple("01234"))} >= {"batch"}


async def test_bad_lines_fail_the_batch_with_their_line_numbers(harness_redis: HarnessRedis, tmp_path: Path) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        wrong_url = {**chat_line("c", "x"), "url": "/v1/completions"}
        lines = [chat_line("a", "x"), chat_line("a", "y"), wrong_url, chat_line("d", "z", stream=True), b"{not json"]
        lines.append(chat_line("f", "w", temperature=-1.0))
        batch_id = await submit(h, jsonl(lines))
        assert await BatchRun(gateway(h), "tenant-a", batch_id, window=2).run() is BatchStatus.FAILED
        batch = (await h.http.get(f"/v1/batches/{batch_id}", headers=A)).json()
        assert batch["status"] == "failed" and batch["failed_at"]
        assert [error["line"] for error in batch["errors"]["data"]] == [2, 3, 4, 5, 6]
        assert batch["errors"]["data"][0]["code"] == "duplicate_custom_id"
        assert h.worker.requests == []


async def test_a_line_asking_for_interactive_priority_fails_the_batch_naming_it(
    harness_redis: HarnessRedis, tmp_path: Path
) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        lines = [chat_line("a", "x", priority="batch"), chat_line("b", "y", priority="interactive")]
        batch_id = await submit(h, jsonl(lines))
        assert await BatchRun(gateway(h), "tenant-a", batch_id, window=2).run() is BatchStatus.FAILED
        errors = (await h.http.get(f"/v1/batches/{batch_id}", headers=A)).json()["errors"]["data"]
        assert [(e["line"], e["code"], e["param"]) for e in errors] == [(2, "invalid_request", "body.priority")]
        assert "'interactive'" in errors[0]["message"]
        assert h.worker.requests == []  # never run at another priority than it asked for


async def test_a_restarted_run_keeps_finished_lines_and_runs_only_the_rest(
    harness_redis: HarnessRedis, tmp_path: Path
) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        batch_id = await submit(h, jsonl([chat_line(f"req-{i}", f"hi {i}") for i in range(4)]))
        store = gateway(h).batches
        run = BatchRun(gateway(h), "tenant-a", batch_id, window=1)
        first = await run.run()
        assert first is BatchStatus.COMPLETED
        ran = len(h.worker.requests)
        finished = await store.get("tenant-a", batch_id)
        assert not await h.redis.exists(h.keys.batch_results("tenant-a", batch_id))  # the files hold them now
        # as if the runner had died after keeping two lines: those two kept, back to in_progress
        kept = {line["custom_id"]: json.dumps(line) for line in await content(h, str(finished.output_file_id))}
        await h.redis.hset(h.keys.batch_results("tenant-a", batch_id), mapping={c: kept[c] for c in ("req-0", "req-1")})
        await h.redis.hset(h.keys.batch("tenant-a", batch_id), mapping={"status": "in_progress"})
        assert await BatchRun(gateway(h), "tenant-a", batch_id, window=1).run() is BatchStatus.COMPLETED
        assert len(h.worker.requests) == ran  # lines 3 and 4 had records: followed, not run again
        batch = await store.get("tenant-a", batch_id)
        assert batch.request_counts.completed == 4
        output = await content(h, str(batch.output_file_id))
        assert sorted(line["custom_id"] for line in output) == [f"req-{i}" for i in range(4)]


async def test_batch_lines_are_never_refused_by_the_queue_bound(
    harness_redis: HarnessRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's window bounds its lines; the 429 bound is for clients (a full queue must not fail lines)."""

    async def always_full(self: FleetAdmission, *args: object, **kwargs: object) -> None:
        raise QueueFull(1.0)

    async with gateway_harness(
        api_keys=KEYS,
        files_dir=tmp_path,
        max_queue=1,
        redis_url=harness_redis.url,
        jobs_redis_url=harness_redis.jobs_url,
    ) as h:
        monkeypatch.setattr(FleetAdmission, "admit", always_full)
        assert (
            await h.http.post("/v1/chat/completions", headers=A, json=chat_line("x", "hi")["body"])
        ).status_code == 429
        batch_id = await submit(h, jsonl([chat_line(f"req-{i}", f"hi {i}") for i in range(6)]))
        assert await BatchRun(gateway(h), "tenant-a", batch_id, window=4).run() is BatchStatus.COMPLETED
        batch = await gateway(h).batches.get("tenant-a", batch_id)
        assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 0)


async def test_a_line_kept_but_not_counted_when_the_cancel_came_is_counted(
    harness_redis: HarnessRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel stops line tasks wherever they are, even between keeping a line and counting it:
    the final counts are the files' lines."""
    counting = BatchStore.add_result
    kept = asyncio.Event()

    async def keep_then_wait(self: BatchStore, tenant: str, batch_id: str, custom_id: str, line: str, *, ok: bool):
        if custom_id != "req-0":
            return await counting(self, tenant, batch_id, custom_id, line, ok=ok)
        await h.redis.hsetnx(h.keys.batch_results(tenant, batch_id), custom_id, line)
        kept.set()
        await asyncio.Event().wait()  # the cancel finds the line here: kept, not counted

    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        monkeypatch.setattr(BatchStore, "add_result", keep_then_wait)
        # this test runs the batch itself: to the cancel route its RQ job is a started one
        monkeypatch.setattr(BatchJobQueue, "cancel_unless_running", lambda self, batch_id: False)
        batch_id = await submit(h, jsonl([chat_line(f"req-{i}", f"hi {i}") for i in range(3)]))
        run = asyncio.create_task(BatchRun(gateway(h), "tenant-a", batch_id, window=1, poll_s=0.01).run())
        await asyncio.wait_for(kept.wait(), 30)
        assert (await h.http.post(f"/v1/batches/{batch_id}/cancel", headers=A)).status_code == 200
        assert await asyncio.wait_for(run, 30) is BatchStatus.CANCELLED
        batch = await gateway(h).batches.get("tenant-a", batch_id)
        output = await content(h, str(batch.output_file_id))
        errors = await content(h, str(batch.error_file_id))
        assert [line["custom_id"] for line in output] == ["req-0"]
        assert [line["custom_id"] for line in errors] == ["req-1", "req-2"]
        assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 0)


@pytest.mark.parametrize("how", ["bytes-deleted", "metadata-deleted", "unreadable"])
async def test_an_input_gone_or_unreadable_fails_the_batch_at_once(
    harness_redis: HarnessRedis, tmp_path: Path, how: str
) -> None:
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        batch_id = await submit(h, jsonl([chat_line("a", "hi")]))
        input_id = (await gateway(h).batches.get("tenant-a", batch_id)).input_file_id
        path = tmp_path / "tenant-a" / input_id
        if how == "bytes-deleted":
            path.unlink()
        elif how == "metadata-deleted":
            await h.redis.delete(h.keys.file("tenant-a", input_id))
        else:
            path.unlink()
            path.mkdir()  # reading it raises IsADirectoryError, whoever the tests run as
        assert await BatchRun(gateway(h), "tenant-a", batch_id, window=1).run() is BatchStatus.FAILED
        batch = await gateway(h).batches.get("tenant-a", batch_id)
        assert batch.errors is not None and batch.failed_at is not None
        expected = "input_file_unreadable" if how == "unreadable" else "input_file_missing"
        assert [(error.code, error.param) for error in batch.errors.data] == [(expected, "input_file_id")]
        assert h.worker.requests == []


@pytest.mark.parametrize("input_state", ["missing", "bad-lines"])
async def test_a_cancelled_batch_that_cannot_run_ends_cancelled(
    harness_redis: HarnessRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, input_state: str
) -> None:
    """A cancel that came before the runner found the input unusable wins: ``cancelled``, not ``failed``."""
    monkeypatch.setattr(BatchJobQueue, "cancel_unless_running", lambda self, batch_id: False)
    async with gateway_harness(
        api_keys=KEYS, files_dir=tmp_path, redis_url=harness_redis.url, jobs_redis_url=harness_redis.jobs_url
    ) as h:
        batch_id = await submit(h, jsonl([chat_line("a", "hi"), chat_line("a", "again")]))
        if input_state == "missing":
            (tmp_path / "tenant-a" / (await gateway(h).batches.get("tenant-a", batch_id)).input_file_id).unlink()
        assert (await h.http.post(f"/v1/batches/{batch_id}/cancel", headers=A)).json()["status"] == "cancelling"
        assert await BatchRun(gateway(h), "tenant-a", batch_id, window=1).run() is BatchStatus.CANCELLED
        assert (await gateway(h).batches.get("tenant-a", batch_id)).status is BatchStatus.CANCELLED
