from __future__ import annotations

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
from metrale.shared.keys import Keys
from metrale.shared.messages import ModelAnnouncement, WorkerHeartbeat
from metrale.text.builtin_tokenizer import EOS_ID, IM_END_ID, build_builtin_tokenizer
from tests.gateway.harness import MODEL, announcement

pytestmark = pytest.mark.anyio


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[redis.asyncio.Redis, Keys]]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client, Keys(f"met-test-{uuid.uuid4().hex[:12]}")
    await client.aclose()


async def announce(client: redis.asyncio.Redis, keys: Keys, model: ModelAnnouncement) -> None:
    await client.hset(keys.model(model.model), "msg", encode(model))


async def beat(client: redis.asyncio.Redis, keys: Keys, worker_id: str, model: str) -> None:
    now = time.time()
    heartbeat = WorkerHeartbeat(worker_id, model, 1, 0, 0, 1, 10.0, 7, 60, now, now)
    await client.hset(keys.worker(worker_id), "msg", encode(heartbeat))
    await client.expire(keys.worker(worker_id), 30)


async def test_a_model_is_live_when_a_worker_heartbeat_names_it(fleet: tuple[redis.asyncio.Redis, Keys]) -> None:
    client, keys = fleet
    await announce(client, keys, announcement())
    await beat(client, keys, "w-1", MODEL)
    await beat(client, keys, "w-2", "other-model")
    await client.hset(keys.worker("w-3"), "msg", b"not msgpack")
    registry = ModelRegistry(client, keys)
    assert sorted(w.worker_id for w in await registry.live_workers()) == ["w-1", "w-2"]
    assert await registry.live_model_names() == sorted([MODEL, "other-model"])
    served = await registry.resolve(MODEL)
    assert (served.name, served.max_model_len) == (MODEL, announcement().max_model_len)


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
