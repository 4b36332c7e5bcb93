from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import fakeredis
import pytest
import redis.asyncio

from metrale.gateway.fleet.registry import ModelRegistry, build_tokenizer
from metrale.shared.codec import encode
from metrale.shared.errors import ModelNotFound, NoWorker
from metrale.shared.heartbeats import queue_heartbeat, queue_withdrawal
from metrale.shared.keys import Keys
from metrale.shared.messages import ModelAnnouncement, WorkerHeartbeat
from metrale.shared.redis_connect import AsyncClient, connect_async
from metrale.text.builtin_tokenizer import EOS_ID, IM_END_ID, build_builtin_tokenizer
from tests.gateway.harness import MODEL, announcement

pytestmark = pytest.mark.anyio


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[redis.asyncio.Redis, Keys]]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client, Keys(f"met-test-{uuid.uuid4().hex[:12]}")
    await client.aclose()


async def announce(client: AsyncClient, keys: Keys, model: ModelAnnouncement) -> None:
    await client.hset(keys.model(model.model), "msg", encode(model))


async def beat(client: AsyncClient, keys: Keys, worker_id: str, model: str) -> None:
    now = time.time()
    heartbeat = WorkerHeartbeat(worker_id, model, 1, 0, 0, 1, 10.0, 7, 60, now, now)
    async with client.pipeline(transaction=True) as pipe:
        queue_heartbeat(pipe, heartbeat, ttl_s=30, keys=keys)
        await pipe.execute()


async def test_a_model_is_live_when_a_worker_heartbeat_names_it(fleet: tuple[redis.asyncio.Redis, Keys]) -> None:
    client, keys = fleet
    await announce(client, keys, announcement())
    await beat(client, keys, "w-1", MODEL)
    await beat(client, keys, "w-2", "other-model")
    await client.hset(keys.worker("w-3"), "msg", b"not msgpack")
    await client.zadd(keys.worker_index(), {"w-3": time.time()})
    await client.zadd(keys.worker_index(), {"w-4": time.time()})  # lost: indexed, no heartbeat
    registry = ModelRegistry(client, keys)
    assert sorted(w.worker_id for w in await registry.live_workers()) == ["w-1", "w-2"]
    assert await registry.live_model_names() == sorted([MODEL, "other-model"])
    served = await registry.resolve(MODEL)
    assert (served.name, served.max_model_len) == (MODEL, announcement().max_model_len)


async def test_live_workers_are_read_through_the_index_on_one_redis_and_a_cluster(any_redis_url: str) -> None:
    """Heartbeats written as workers write them (one transaction over the control keys: one slot on a
    cluster), a lost worker left in the index and a withdrawn one: the live are found without a SCAN."""
    client = connect_async(any_redis_url)
    keys = Keys.for_redis(any_redis_url, f"met-test-{uuid.uuid4().hex[:12]}")
    try:
        await announce(client, keys, announcement())
        for worker_id in ("w-1", "w-2", "w-lost"):
            await beat(client, keys, worker_id, MODEL)
        await client.delete(keys.worker("w-lost"))  # died: its index entry outlives its heartbeat
        async with client.pipeline(transaction=True) as pipe:
            queue_withdrawal(pipe, "w-2", keys=keys)
            await pipe.execute()
        registry = ModelRegistry(client, keys)
        assert [w.worker_id for w in await registry.live_workers()] == ["w-1"]
        assert (await registry.resolve(MODEL)).name == MODEL
    finally:
        await client.aclose()


async def test_unknown_is_404_and_known_without_worker_is_503(fleet: tuple[redis.asyncio.Redis, Keys]) -> None:
    client, keys = fleet
    await announce(client, keys, announcement())
    registry = ModelRegistry(client, keys)
    with pytest.raises(ModelNotFound):
        await registry.resolve("never-announced")
    with pytest.raises(NoWorker):
        await registry.resolve(MODEL)


async def test_a_worker_newer_than_the_cached_scan_is_found_and_an_unknown_model_costs_no_scan(
    fleet: tuple[redis.asyncio.Redis, Keys], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, keys = fleet
    await announce(client, keys, announcement())
    registry = ModelRegistry(client, keys, liveness_cache_s=3600.0)
    assert await registry.live_model_names() == []  # cached: no worker yet
    await beat(client, keys, "w-1", MODEL)
    assert (await registry.resolve(MODEL)).name == MODEL  # looked again before a 503

    scans = 0
    scan_iter = client.scan_iter

    def counted(*args: object, **kwargs: object) -> AsyncIterator[bytes]:
        nonlocal scans
        scans += 1
        return scan_iter(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client, "scan_iter", counted)
    with pytest.raises(ModelNotFound):
        await registry.resolve("never-announced")
    assert scans == 0


async def test_tokenizers_are_built_once_per_fingerprint(fleet: tuple[redis.asyncio.Redis, Keys]) -> None:
    client, keys = fleet
    await announce(client, keys, announcement())
    await beat(client, keys, "w-1", MODEL)
    registry = ModelRegistry(client, keys, announcement_refresh_s=0.0)
    first = await registry.resolve(MODEL)
    again = await registry.resolve(MODEL)
    assert again.tokenizer is first.tokenizer
    retrained = dataclasses.replace(announcement(), fingerprint="cd" * 32, max_model_len=128)
    await announce(client, keys, retrained)
    changed = await registry.resolve(MODEL)
    assert changed.tokenizer is not first.tokenizer
    assert changed.max_model_len == 128


def test_the_announced_tokenizer_matches_the_workers() -> None:
    tokenizer = build_tokenizer(announcement())
    reference = build_builtin_tokenizer()
    text = "The light flashed every 7.5 seconds; «ünïcode» too."
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.chat_template is not None
    assert {EOS_ID, IM_END_ID} <= tokenizer.eos_token_ids


async def test_a_burst_resolving_a_cold_model_reads_it_once_and_watch_resolves_it_ahead(
    fleet: tuple[redis.asyncio.Redis, Keys], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, keys = fleet
    await announce(client, keys, announcement())
    await beat(client, keys, "w-1", MODEL)
    builds = 0

    def counted_build(model: ModelAnnouncement) -> object:
        nonlocal builds
        builds += 1
        return build_tokenizer(model)

    monkeypatch.setattr("metrale.gateway.fleet.registry.build_tokenizer", counted_build)
    registry = ModelRegistry(client, keys)
    served = await asyncio.gather(*(registry.resolve(MODEL) for _ in range(50)))
    assert builds == 1 and len({id(model) for model in served}) == 1
    assert "max_chars_per_token" in served[0].tokenizer.__dict__  # worked out off the loop

    watched = ModelRegistry(client, keys)
    watch = asyncio.create_task(watched.watch())
    try:
        for _ in range(200):
            if watched._models.get(MODEL) is not None:
                break
            await asyncio.sleep(0.01)
        assert watched._models.get(MODEL) is not None, "watch did not resolve the live model ahead"
    finally:
        watch.cancel()
