"""A gateway app on fakeredis (or a real Redis, or a Redis Cluster) with a fake worker, driven through
httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, cast

import fakeredis
import httpx
import redis
import redis.asyncio
from fastapi import FastAPI
from redis import Redis as SyncRedis
from tokenizers import Tokenizer

from metrale.gateway.app import create_app
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, GenerateRequest, ModelAnnouncement
from metrale.shared.record import RunRecord, read_record_async
from metrale.shared.redis_connect import connect_async, is_cluster
from metrale.shared.settings import (
    MAX_FILE_BYTES,
    MAX_FILE_LINES,
    GatewaySettings,
    RequestLimits,
    StorageQuotas,
    TenantLimits,
)
from metrale.text.builtin_tokenizer import (
    BUILTIN_VOCAB_SIZE,
    EOS_ID,
    STOP_TOKEN_IDS,
    build_builtin_tokenizer,
    builtin_tokenizer_config,
)
from tests.gateway.fake_worker import FakeWorker, FakeWorkerScript

MODEL = "tiny-kimi"
MAX_MODEL_LEN = 64
REPLY_TEXT = "The lighthouse keeper woke before dawn."


@cache
def announcement() -> ModelAnnouncement:
    """The built-in tokenizer, announced as ``MODEL`` with a 64-token context."""
    return ModelAnnouncement(
        model=MODEL,
        tokenizer_json=build_builtin_tokenizer().to_str(),
        tokenizer_config_json=json.dumps(builtin_tokenizer_config()),
        max_model_len=MAX_MODEL_LEN,
        vocab_size=BUILTIN_VOCAB_SIZE,
        eos_token_ids=list(STOP_TOKEN_IDS),
        fingerprint="ab" * 32,
    )


@cache
def _tokenizer() -> Tokenizer:
    return build_builtin_tokenizer()


def encode(text: str) -> list[int]:
    """Token ids of ``text`` under the built-in tokenizer, no special tokens."""
    return list(_tokenizer().encode(text, add_special_tokens=False).ids)


def token_text(token_id: int) -> str:
    """One token's text, special tokens included."""
    return str(_tokenizer().decode([token_id], skip_special_tokens=False))


def choice_text(index: int) -> str:
    """What the default script answers for choice ``index``."""
    return REPLY_TEXT if index == 0 else f"Choice {index}: {REPLY_TEXT}"


def reply_with_eos(request: GenerateRequest, index: int) -> list[int]:
    """The default script: ``choice_text(index)`` then EOS."""
    return [*encode(choice_text(index)), EOS_ID]


@dataclass
class Harness:
    """What a test drives: the HTTP client, the worker, and the Redis both share."""

    http: httpx.AsyncClient
    transport: httpx.ASGITransport
    app: FastAPI
    redis: redis.asyncio.Redis
    keys: Keys
    worker: FakeWorker
    job_client: SyncRedis | None
    settings: GatewaySettings

    @property
    def jobs(self) -> SyncRedis:
        """RQ's Redis (on a cluster, the harness's ``jobs_redis_url``)."""
        assert self.job_client is not None, "this harness has no job queue: give it jobs_redis_url"
        return self.job_client


@contextlib.asynccontextmanager
async def gateway_harness(
    script: FakeWorkerScript | None = None,
    *,
    worker_running: bool = True,
    api_keys: Mapping[str, str] | None = None,
    request_timeout_s: float = 5.0,
    max_queue: int = 100,
    max_queue_wait_s: float = 30.0,
    tenant_limits: Mapping[str, TenantLimits] | None = None,
    redis_url: str | None = None,
    jobs_redis_url: str | None = None,
    files_dir: Path | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_file_lines: int = MAX_FILE_LINES,
    model: ModelAnnouncement | None = None,
    tool_call_parser: str | None = None,
    request_limits: RequestLimits | None = None,
    quotas: StorageQuotas | None = None,
) -> AsyncIterator[Harness]:
    """A started gateway app and a fake worker (announced; serving unless ``worker_running`` is off).

    fakeredis unless ``redis_url`` names a real server (one Redis, or a Redis Cluster: keys sharded as
    ``Keys.for_redis`` shards them); keys live in a namespace of their own. RQ's jobs go to
    ``jobs_redis_url``, else to ``redis_url`` unless that is a cluster (no job queue then). The Files API
    stores bytes under ``files_dir`` (without one it answers 503). ``model`` replaces the built-in
    tokenizer's announcement.
    """
    client: redis.asyncio.Redis
    job_client: redis.Redis | None
    if redis_url is None:
        server = fakeredis.FakeServer()
        client, job_client = fakeredis.FakeAsyncRedis(server=server), fakeredis.FakeRedis(server=server)
    else:
        # A cluster's client answers the same calls (the gateway's types name one Redis's, as connect_redis does).
        client = cast(redis.asyncio.Redis, connect_async(redis_url))
        jobs_url = jobs_redis_url or (None if is_cluster(client) else redis_url)
        job_client = redis.Redis.from_url(jobs_url) if jobs_url is not None else None
    keys = Keys.for_redis(redis_url, f"met-test-{uuid.uuid4().hex[:12]}")
    settings = GatewaySettings(
        redis_url=redis_url if keys.shards > 1 else None,  # the settings' keys: sharded on a cluster
        api_keys=dict(api_keys or {}),
        request_timeout_s=request_timeout_s,
        max_queue=max_queue,
        max_queue_wait_s=max_queue_wait_s,
        tenant_limits=dict(tenant_limits or {}),
        heartbeat_ttl_s=10,
        namespace=keys.namespace,
        files_dir=files_dir,
        max_file_bytes=max_file_bytes,
        max_file_lines=max_file_lines,
        tool_call_parser=tool_call_parser,
        request_limits=request_limits or RequestLimits(),
        quotas=quotas or StorageQuotas(),
    )
    app = create_app(settings, redis=client, job_client=job_client)
    worker = FakeWorker(client, keys, model or announcement(), script or FakeWorkerScript(reply_with_eos))
    await worker.announce()
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as http,
    ):
        serving = asyncio.create_task(worker.run()) if worker_running else None
        try:
            yield Harness(http, transport, app, client, keys, worker, job_client, settings)
        finally:
            worker.stopping.set()
            if serving is not None:
                await serving
    await client.aclose()
    if job_client is not None:
        job_client.close()


async def eventually(condition: Callable[[], Awaitable[bool]], timeout_s: float = 3.0) -> None:
    """Wait until ``condition()`` holds; fail after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(0.005)


async def aborted_record(h: Harness, request_id: str, timeout_s: float = 1.0) -> RunRecord:
    """``request_id``'s record once it has ended with ``abort`` (a cancel reached its worker); fails
    after ``timeout_s``."""
    record: RunRecord | None = None

    async def aborted() -> bool:
        nonlocal record
        record = await read_record_async(h.redis, request_id, keys=h.keys)
        return record is not None and record.finish_reason is FinishReason.ABORT

    await eventually(aborted, timeout_s=timeout_s)
    assert record is not None
    return record


async def counted(h: Harness, field: str, expected: int) -> bool:
    """Whether the gateway counter ``field`` reaches ``expected`` (written in the background: waits
    up to 3 s); False if it does not, or goes past it."""

    async def reached() -> bool:
        value = await h.redis.hget(h.keys.gateway_counters(), field)
        return int(value or 0) >= expected

    try:
        await eventually(reached)
    except TimeoutError:
        return False
    return int(await h.redis.hget(h.keys.gateway_counters(), field) or 0) == expected


def sse_payloads(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, checking it ends with ``data: [DONE]``."""
    events = [block.removeprefix("data: ") for block in body.split("\n\n") if block]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(event) for event in events[:-1]]
