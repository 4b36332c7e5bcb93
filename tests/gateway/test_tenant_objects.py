"""A tenant's objects on a real Redis — one, and a Redis Cluster, where each tenant's keys share the
tenant's hash slot and the fleet-wide sets lie elsewhere: sessions (the gateway's transcript and the
worker's checkpoint record), stored and background responses, files. Every transaction of these stores
runs here, so a cluster refusing one (``CROSSSLOT``) fails a test."""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from metrale.gateway.batches.file_store import FileStore
from metrale.gateway.fleet.session_store import SessionStore
from metrale.gateway.responses.background_store import BackgroundStatus, BackgroundStore
from metrale.gateway.responses.output import OutputEvent
from metrale.gateway.responses.store import ResponseStore, StoredResponse, UnstoredResponse
from metrale.shared.errors import NotFound, QuotaExceeded
from metrale.shared.keys import Keys
from metrale.shared.redis_connect import AsyncClient, connect_async, connect_sync
from metrale.shared.sessions import SessionEntry, Transcript
from metrale.worker.checkpoints.sessions import RedisSessions

pytestmark = pytest.mark.anyio

TENANT = "acme"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def keys(any_redis_url: str) -> Keys:
    return Keys.for_redis(any_redis_url, f"met-test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def client(any_redis_url: str) -> AsyncIterator[AsyncClient]:
    connection = connect_async(any_redis_url)
    yield connection
    await connection.aclose()


async def test_a_sessions_transcript_and_checkpoint_record(any_redis_url: str, client: AsyncClient, keys: Keys) -> None:
    gateway = SessionStore(client, keys)
    worker_client = connect_sync(any_redis_url)
    worker = RedisSessions(worker_client, keys)
    transcript = Transcript("<|user|>hi<|assistant|>hello", (1, 2, 3, 4), prompt_length=2)
    await gateway.save_transcript(TENANT, "s1", transcript)
    assert await gateway.transcript(TENANT, "s1") == transcript
    checkpoint = keys.checkpoint("fp", TENANT, "abc")
    await client.set(checkpoint, b"state")
    entry = SessionEntry(3, "abc", 5, "redis", checkpoint, last_use=1.0)
    worker.record(TENANT, "s1", entry)
    worker.count_retokenized(TENANT, "s1")
    assert worker.get(TENANT, "s1") == entry
    assert (await gateway.entry(TENANT, "s1"), await gateway.retokenized(TENANT, "s1")) == (entry, 1)
    assert await gateway.delete(TENANT, "s1")  # its record, transcript and checkpoint: keys of two slots
    assert not await client.exists(keys.session(TENANT, "s1"), keys.session_transcript(TENANT, "s1"), checkpoint)
    assert await gateway.transcript(TENANT, "s1") is None
    worker_client.close()


def stored(response_id: str) -> StoredResponse:
    body = {"id": response_id, "object": "response", "status": "completed", "output": []}
    return StoredResponse(body, [{"role": "user", "content": "hi"}], [], Transcript("hi", (5, 6), 1), "hi", "")


async def test_stored_responses_within_the_quota_and_deleted(client: AsyncClient, keys: Keys) -> None:
    responses = ResponseStore(client, keys, ttl_s=60, max_stored=2)
    for response_id in ("resp_1", "resp_2"):
        await responses.check_room(TENANT)
        await responses.save(TENANT, stored(response_id))
    with pytest.raises(QuotaExceeded):
        await responses.check_room(TENANT)
    await responses.check_room("globex")  # its own quota
    got = await responses.get(TENANT, "resp_1")
    assert isinstance(got, StoredResponse) and got.transcript.token_ids == (5, 6)
    await responses.mark_unstored(TENANT, "resp_3")
    assert await responses.get(TENANT, "resp_3") == UnstoredResponse("resp_3")
    assert await responses.get("globex", "resp_1") is None
    assert await responses.delete(TENANT, "resp_1") and not await responses.delete(TENANT, "resp_1")
    await responses.check_room(TENANT)


async def test_a_background_response_runs_its_course(client: AsyncClient, keys: Keys) -> None:
    background = BackgroundStore(client, keys, ttl_s=60)
    body = {"id": "resp_bg", "object": "response", "status": "queued", "output": []}
    now = time.time()
    opening = [OutputEvent("response.created", {"response": body}), OutputEvent("response.queued", {"response": body})]
    await background.create(TENANT, body, request_json="{}", created_at=now, deadline=now + 60, events=opening)
    assert await background.start(
        TENANT, "resp_bg", {**body, "status": "in_progress"}, OutputEvent("response.in_progress", {})
    )
    assert not await background.start(TENANT, "resp_bg", body, OutputEvent("response.in_progress", {}))
    assert await background.append(
        TENANT, "resp_bg", [OutputEvent("response.output_text.delta", {"delta": "hi"})], read_chars=2
    )
    done = stored("resp_bg")
    assert await background.finish(TENANT, done, [OutputEvent("response.completed", {"response": done.body})])
    assert await background.status(TENANT, "resp_bg") is BackgroundStatus.COMPLETED
    events = await background.read(TENANT, "resp_bg", -1, block_ms=None)
    assert [json.loads(event)["sequence_number"] for event in events] == [0, 1, 2, 3, 4]
    assert not await background.cancel(TENANT, "resp_bg")  # ended already
    assert await ResponseStore(client, keys, ttl_s=60).delete(TENANT, "resp_bg")
    assert not await client.exists(keys.response_events(TENANT, "resp_bg"))


async def test_files_are_stored_listed_expired_and_deleted(client: AsyncClient, keys: Keys, tmp_path: Path) -> None:
    files = FileStore(client, keys, tmp_path, max_bytes=1000, max_lines=10)

    def write(out: io.BufferedIOBase) -> None:
        out.write(b'{"custom_id": "a"}\n')

    kept = await files.create(TENANT, write, filename="in.jsonl", purpose="batch")  # type: ignore[arg-type]
    expiring = await files.create(TENANT, write, filename="out.jsonl", purpose="batch_output", expires_after_s=1)  # type: ignore[arg-type]
    listed = await files.list(TENANT, purpose=None, limit=10, after=None)
    assert sorted(found.id for found in listed) == sorted([kept.id, expiring.id])
    await client.zadd(keys.file_expiry(), {f"{TENANT}:{expiring.id}": time.time() - 1})  # its time has come
    assert await files.sweep_expired() == 1
    assert not files.path(TENANT, expiring.id).exists()
    assert [found.id for found in await files.list(TENANT, purpose=None, limit=10, after=None)] == [kept.id]
    await files.delete(TENANT, kept.id)
    with pytest.raises(NotFound):
        await files.get(TENANT, kept.id)
    assert await client.hlen(keys.file_sizes(TENANT)) == 0 and await client.zcard(keys.file_expiry()) == 0
