"""Background responses on the gateway harness (fakeredis, and a Redis Cluster), their job run here
(``BackgroundRun``, as a batch runner runs it): ``queued`` → ``in_progress`` → ``completed``,
``retrieve`` while it runs, streams resumed after any ``sequence_number`` with no gap or duplicate,
cancel (idempotent, the fleet request cancelled), a job run again after its runner died continuing the
events, and tenants kept apart."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from metrale.batch.background_response import BackgroundRun
from metrale.gateway.batches.job_queue import RESPONSE_JOB_FUNCTION
from metrale.gateway.responses.background_store import BackgroundStatus, BackgroundStore
from metrale.gateway.state import Gateway
from metrale.gateway.streams import generation
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import (
    MODEL,
    REPLY_TEXT,
    Harness,
    aborted_record,
    announcement,
    gateway_harness,
    reply_with_eos,
)
from tests.redis_kinds import HarnessRedis

pytestmark = pytest.mark.anyio

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}
A = {"Authorization": "Bearer sk-a"}
B = {"Authorization": "Bearer sk-b"}
SLOW = FakeWorkerScript(reply_with_eos, step_s=0.02)


def body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "input": "Hello there.", "max_output_tokens": 32, "background": True, **extra}


def harness(
    where: HarnessRedis, script: FakeWorkerScript | None = None
) -> contextlib.AbstractAsyncContextManager[Harness]:
    """The gateway harness on ``where``, with room for a conversation to continue."""
    model = dataclasses.replace(announcement(), max_model_len=1024)
    return gateway_harness(script, api_keys=KEYS, model=model, redis_url=where.url, jobs_redis_url=where.jobs_url)


def gateway_of(h: Harness) -> Gateway:
    gateway: Gateway = h.app.state.gateway
    return gateway


async def run_job(h: Harness, response_id: str, tenant: str = "tenant-a") -> str:
    """What a batch runner does with the response's job."""
    return await BackgroundRun(gateway_of(h), tenant, response_id).run()


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a Responses stream, checking each ``event:`` line names its data's type."""
    kind = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            event = json.loads(line.removeprefix("data: "))
            assert event["type"] == kind
            yield event


async def read_stream(h: Harness, response_id: str, starting_after: int | None = None) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"stream": "true"}
    if starting_after is not None:
        params["starting_after"] = starting_after
    async with h.http.stream("GET", f"/v1/responses/{response_id}", params=params, headers=A) as response:
        assert response.status_code == 200, await response.aread()
        return [event async for event in sse_events(response)]


def deltas(events: list[dict[str, Any]]) -> str:
    return "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")


async def test_a_background_response_is_queued_then_run_by_its_job_and_kept(harness_redis: HarnessRedis) -> None:
    async with harness(harness_redis) as h:
        created = await h.http.post("/v1/responses", headers=A, json=body())
        assert created.status_code == 200, created.text
        queued = created.json()
        assert (queued["status"], queued["background"], queued["output"]) == ("queued", True, [])
        response_id = queued["id"]
        assert h.worker.requests == []  # the job runs it, not the gateway
        jobs = gateway_of(h).batch_jobs
        assert jobs is not None
        assert [job.func_name for job in jobs.response_queue.jobs] == [RESPONSE_JOB_FUNCTION]
        assert jobs.response_queue.jobs[0].args == ("tenant-a", response_id)
        assert (await h.http.get(f"/v1/responses/{response_id}", headers=A)).json()["status"] == "queued"

        assert await run_job(h, response_id) == "completed"
        done = (await h.http.get(f"/v1/responses/{response_id}", headers=A)).json()
        assert (done["status"], done["background"]) == ("completed", True)
        assert done["output"][0]["content"][0]["text"] == REPLY_TEXT
        assert done["usage"]["output_tokens"] > 0

        events = await read_stream(h, response_id)
        assert [event["sequence_number"] for event in events] == list(range(len(events)))
        kinds = [event["type"] for event in events]
        assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
        assert kinds[-1] == "response.completed" and events[-1]["response"] == done
        assert deltas(events) == REPLY_TEXT
        for after in range(len(events)):  # resumed after any event: the rest, exactly
            assert await read_stream(h, response_id, starting_after=after) == events[after + 1 :]

        # it continues like any stored response, from its exact tokens
        follow = await h.http.post(
            "/v1/responses", headers=A, json=body(background=False, previous_response_id=response_id)
        )
        assert follow.status_code == 200, follow.text
        assert await run_job(h, response_id) == "completed"  # a job run again after its end changes nothing
        assert len(await read_stream(h, response_id)) == len(events)


@contextlib.asynccontextmanager
async def job_runner(h: Harness) -> AsyncIterator[None]:
    """Runs every background response's job the gateway enqueues (a batch runner's part), as it comes."""
    jobs = gateway_of(h).batch_jobs
    assert jobs is not None
    runs: dict[str, asyncio.Task[str]] = {}

    async def take() -> None:
        while True:
            for job in await asyncio.to_thread(lambda: jobs.response_queue.jobs):
                if job.id not in runs:
                    runs[job.id] = asyncio.create_task(run_job(h, job.args[1], job.args[0]))
            await asyncio.sleep(0.01)

    taking = asyncio.create_task(take())
    try:
        yield
    finally:
        taking.cancel()
        await asyncio.gather(taking, *runs.values(), return_exceptions=True)


async def test_create_with_stream_streams_the_jobs_events(harness_redis: HarnessRedis) -> None:
    async with harness(harness_redis, SLOW) as h, job_runner(h):
        # (httpx's ASGI transport hands the body over once it is whole: the client leaving mid-stream
        # is tests/failover/test_background_responses.py's)
        async with h.http.stream("POST", "/v1/responses", headers=A, json=body(stream=True)) as response:
            assert response.status_code == 200
            events = [event async for event in sse_events(response)]
        response_id = events[0]["response"]["id"]
        assert (events[0]["type"], events[0]["response"]["status"]) == ("response.created", "queued")
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert deltas(events) == REPLY_TEXT and events[-1]["type"] == "response.completed"
        assert await read_stream(h, response_id) == events


async def test_retrieve_shows_the_output_so_far_while_it_runs(harness_redis: HarnessRedis) -> None:
    async with harness(harness_redis, FakeWorkerScript(reply_with_eos, step_s=0.05)) as h:
        response_id = (await h.http.post("/v1/responses", headers=A, json=body())).json()["id"]
        job = asyncio.create_task(run_job(h, response_id))
        partial = ""
        while not job.done() and not partial:
            running = (await h.http.get(f"/v1/responses/{response_id}", headers=A)).json()
            if running["status"] == "in_progress" and running["output"]:
                partial = running["output"][0]["content"][0]["text"]
            await asyncio.sleep(0.01)
        assert partial and REPLY_TEXT.startswith(partial) and partial != REPLY_TEXT
        assert await job == "completed"


async def test_cancel_ends_it_cancels_its_fleet_request_and_is_idempotent(harness_redis: HarnessRedis) -> None:
    async with harness(harness_redis, FakeWorkerScript(reply_with_eos, step_s=0.05)) as h:
        response_id = (await h.http.post("/v1/responses", headers=A, json=body())).json()["id"]
        job = asyncio.create_task(run_job(h, response_id))
        reader = asyncio.create_task(read_stream(h, response_id))
        while not (await h.http.get(f"/v1/responses/{response_id}", headers=A)).json()["output"]:
            await asyncio.sleep(0.01)
        cancelled = await h.http.post(f"/v1/responses/{response_id}/cancel", headers=A)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        await aborted_record(h, response_id, timeout_s=3.0)  # the worker stopped generating it
        assert await job == "cancelled"
        events = await asyncio.wait_for(reader, 5.0)  # the stream ends: nothing comes after a cancel
        assert events[-1]["type"] == "response.output_text.delta"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        again = await h.http.post(f"/v1/responses/{response_id}/cancel", headers=A)
        assert again.status_code == 200 and again.json() == cancelled.json()
        assert (await h.http.get(f"/v1/responses/{response_id}", headers=A)).json() == cancelled.json()
        assert await read_stream(h, response_id, starting_after=len(events) - 1) == []


async def test_a_response_cancelled_while_queued_never_runs(harness_redis: HarnessRedis) -> None:
    async with harness(harness_redis) as h:
        response_id = (await h.http.post("/v1/responses", headers=A, json=body())).json()["id"]
        assert (await h.http.post(f"/v1/responses/{response_id}/cancel", headers=A)).json()["status"] == "cancelled"
        assert await run_job(h, response_id) == "cancelled"
        assert h.worker.requests == []
        kinds = [event["type"] for event in await read_stream(h, response_id)]
        assert kinds == ["response.created", "response.queued"]


async def test_a_job_run_again_after_its_runner_died_continues_the_events(
    harness_redis: HarnessRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(harness_redis, FakeWorkerScript(reply_with_eos, step_s=0.02)) as h:
        response_id = (await h.http.post("/v1/responses", headers=A, json=body())).json()["id"]
        store = gateway_of(h).background
        appended = 0
        real_append = BackgroundStore.append

        async def dies_after_three(self: BackgroundStore, *args: Any, **kwargs: Any) -> bool:
            nonlocal appended
            appended += 1
            if appended > 3:
                raise SystemExit("the runner died")  # as kill -9: nothing after this is written
            return await real_append(self, *args, **kwargs)

        async def no_cancel(*_: Any) -> None:
            return None  # a dead runner cancels nothing on the worker

        with monkeypatch.context() as patched:
            patched.setattr(BackgroundStore, "append", dies_after_three)
            patched.setattr(generation, "_cancel", no_cancel)
            with pytest.raises(SystemExit):
                await run_job(h, response_id)
        before = await read_stream_until_now(store, response_id)
        assert 0 < len(deltas(before)) < len(REPLY_TEXT)
        assert await run_job(h, response_id) == "completed"  # RQ's rerun
        assert len(h.worker.requests) == 2  # the request once, and the seal: followed, not submitted again
        events = await read_stream(h, response_id)
        assert events[: len(before)] == before
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert deltas(events) == REPLY_TEXT
        item_ids = {e["item_id"] for e in events if "item_id" in e}
        assert len(item_ids) == 1  # one message item, the same id before and after the rerun
        assert events[-1]["response"]["output"][0]["id"] in item_ids


async def read_stream_until_now(store: BackgroundStore, response_id: str) -> list[dict[str, Any]]:
    return [json.loads(data) for data in await store.read("tenant-a", response_id, -1, block_ms=None)]


async def test_tenants_see_only_their_own_and_store_false_is_refused(harness_redis: HarnessRedis) -> None:
    async with harness(harness_redis) as h:
        response_id = (await h.http.post("/v1/responses", headers=A, json=body())).json()["id"]
        for method, path in [
            ("GET", f"/v1/responses/{response_id}"),
            ("GET", f"/v1/responses/{response_id}?stream=true"),
            ("POST", f"/v1/responses/{response_id}/cancel"),
        ]:
            assert (await h.http.request(method, path, headers=B)).status_code == 404, path
        assert await gateway_of(h).background.status("tenant-a", response_id) is BackgroundStatus.QUEUED
        refused = await h.http.post("/v1/responses", headers=A, json=body(store=False))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"
        # a foreground response cannot be streamed again
        done = (await h.http.post("/v1/responses", headers=A, json=body(background=False))).json()
        again = await h.http.get(f"/v1/responses/{done['id']}", params={"stream": "true"}, headers=A)
        assert again.status_code == 400 and again.json()["error"]["param"] == "stream"


async def test_events_and_object_expire_with_the_response(harness_redis: HarnessRedis) -> None:
    async with harness(harness_redis) as h:
        response_id = (await h.http.post("/v1/responses", headers=A, json=body())).json()["id"]
        assert await run_job(h, response_id) == "completed"
        keys, ttl = h.keys, h.settings.response_ttl_s
        assert 0 < await h.redis.ttl(keys.response("tenant-a", response_id)) <= ttl
        assert 0 < await h.redis.ttl(keys.response_events("tenant-a", response_id)) <= ttl
        await h.http.delete(f"/v1/responses/{response_id}", headers=A)
        assert not await h.redis.exists(keys.response_events("tenant-a", response_id))


async def test_the_openai_client_creates_retrieves_and_resumes(harness_redis: HarnessRedis) -> None:
    async with harness(harness_redis, SLOW) as h:
        http = httpx.AsyncClient(transport=h.transport, timeout=30)
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="sk-a", http_client=http, max_retries=0)
        created = await client.responses.create(model=MODEL, input="Hello there.", background=True)
        assert created.status == "queued" and created.background
        job = asyncio.create_task(run_job(h, created.id))
        resumed = await client.responses.retrieve(created.id, stream=True, starting_after=1)
        events = [event async for event in resumed]
        assert events[0].sequence_number == 2 and events[0].type == "response.in_progress"
        assert events[-1].type == "response.completed"
        assert await job == "completed"
        retrieved = await client.responses.retrieve(created.id)
        assert retrieved.status == "completed" and retrieved.output_text == REPLY_TEXT
        cancelled = await client.responses.cancel(created.id)  # after its end: the response as it is
        assert cancelled.status == "completed"
        await client.close()
