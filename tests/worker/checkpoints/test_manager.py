"""Lookups find the longest valid prefix, never another tenant's, and count every miss by its reason."""

from __future__ import annotations

import uuid

import fakeredis
import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from metrale.shared.keys import Keys
from metrale.worker.checkpoints.format import MissReason
from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.checkpoints.sessions import MemorySessions, RedisSessions
from metrale.worker.checkpoints.store import DirectoryTier, MemoryTier, RedisTier, TieredStore

KEYS = Keys("met-test")


def _state(n: int) -> dict[str, torch.Tensor]:
    return {"kda.0.recurrent": torch.full((2, 3), float(n)), "mla.1.kv": torch.arange(n * 4.0).view(n, 4)}


def _manager(store: TieredStore | None = None, fingerprint: str = "model-a", grid: int = 256) -> CheckpointManager:
    return CheckpointManager(
        store or TieredStore([MemoryTier()]),
        MemorySessions(),
        fingerprint=fingerprint,
        dtype="float32",
        keys=KEYS,
        grid=grid,
    )


PROMPT = list(range(600))


def test_session_checkpoint_is_found_for_a_longer_prompt() -> None:
    manager = _manager()
    manager.save("acme", PROMPT[:300], _state(300), session_id="s1")
    lookup = manager.find("acme", PROMPT, session_id="s1")
    assert lookup.resume is not None and lookup.resume.length == 300
    assert torch.equal(lookup.resume.state["mla.1.kv"], _state(300)["mla.1.kv"])
    assert manager.counters.hits == 1 and manager.counters.tokens_reused == 300


def test_longest_of_grid_and_marks_wins() -> None:
    manager = _manager(grid=256)
    for n in (256, 512, 100):
        manager.save("acme", PROMPT[:n], _state(n))
    assert manager.find("acme", PROMPT, marks=[100]).resume.length == 512  # type: ignore[union-attr]
    assert manager.find("acme", PROMPT[:400], marks=[100]).resume.length == 256  # type: ignore[union-attr]
    assert manager.find("acme", PROMPT[:200], marks=[100]).resume.length == 100  # type: ignore[union-attr]


def test_whole_prompt_is_never_skipped() -> None:
    manager = _manager()
    manager.save("acme", PROMPT[:256], _state(256))
    lookup = manager.find("acme", PROMPT[:256])
    assert lookup.resume is None and lookup.miss is MissReason.NONE


def test_other_tenant_identical_prompt_does_not_hit() -> None:
    manager = _manager()
    manager.save("acme", PROMPT[:256], _state(256), session_id="s")
    lookup = manager.find("globex", PROMPT, session_id="s")
    assert lookup.resume is None and lookup.miss is MissReason.NONE
    assert manager.counters.misses == {"none": 1}


def test_mismatched_token_is_a_token_mismatch_miss() -> None:
    manager = _manager()
    manager.save("acme", PROMPT[:300], _state(300), session_id="s")
    edited = [*PROMPT[:150], 99_999, *PROMPT[151:]]
    lookup = manager.find("acme", edited, session_id="s")
    assert lookup.resume is None and lookup.miss is MissReason.TOKEN_MISMATCH


def test_evicted_session_checkpoint_is_an_evicted_miss() -> None:
    memory = MemoryTier(max_bytes=10_000)
    manager = _manager(TieredStore([memory]))
    manager.save("acme", PROMPT[:300], _state(300), session_id="s")
    for n in range(1, 40):  # fill the LRU with other checkpoints
        manager.save("acme", [7] * n, _state(n))
    lookup = manager.find("acme", PROMPT, session_id="s")
    assert lookup.resume is None and lookup.miss is MissReason.EVICTED


def test_flipped_bytes_are_a_checksum_miss_and_the_entry_is_dropped() -> None:
    memory = MemoryTier()
    manager = _manager(TieredStore([memory]))
    manager.save("acme", PROMPT[:256], _state(256))
    [(key, data)] = list(memory._items.items())
    memory.put(key, data[:-1] + bytes([data[-1] ^ 0xFF]))
    assert manager.find("acme", PROMPT).miss is MissReason.CHECKSUM
    assert memory.get(key) is None


def test_changed_model_is_a_model_changed_miss() -> None:
    store = TieredStore([MemoryTier()])
    old = _manager(store, fingerprint="model-a")
    old.save("acme", PROMPT[:256], _state(256))
    # A new model whose fingerprint differs reads the same key space only if the key matched; simulate a
    # store shared across a weights change under the same fingerprint key by copying the bytes over.
    new = _manager(store, fingerprint="model-b")
    [(key, data)] = list(store.tiers[0]._items.items())  # type: ignore[attr-defined]
    store.put(key.replace("model-a", "model-b"), data)
    assert new.find("acme", PROMPT).miss is MissReason.MODEL_CHANGED


def test_unreachable_redis_is_a_store_unavailable_miss() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    manager = _manager(TieredStore([MemoryTier(), RedisTier(dead)]))
    lookup = manager.find("acme", PROMPT)
    assert lookup.resume is None and lookup.miss is MissReason.STORE_UNAVAILABLE
    manager.save("acme", PROMPT[:256], _state(256))  # the memory tier still takes it
    assert manager.find("acme", PROMPT).resume is not None


def test_another_workers_redis_tier_serves_the_hit() -> None:
    server = fakeredis.FakeServer()
    writer = _manager(TieredStore([MemoryTier(), RedisTier(fakeredis.FakeRedis(server=server))]))
    writer.save("acme", PROMPT[:256], _state(256))
    reader = _manager(TieredStore([MemoryTier(), RedisTier(fakeredis.FakeRedis(server=server))]))
    lookup = reader.find("acme", PROMPT)
    assert lookup.resume is not None and lookup.resume.tier == "redis"
    assert reader.find("acme", PROMPT).resume.tier == "memory"  # type: ignore[union-attr]


def test_directory_tier_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    manager = _manager(TieredStore([DirectoryTier(tmp_path)]))
    manager.save("acme", PROMPT[:256], _state(256))
    assert manager.find("acme", PROMPT).resume.tier == "directory"  # type: ignore[union-attr]


@pytest.mark.redis
def test_real_redis_tiers_and_sessions(real_redis_url: str) -> None:
    client = redis.Redis.from_url(real_redis_url)
    keys = Keys(f"met-test-{uuid.uuid4().hex[:8]}")
    store = TieredStore([RedisTier(client, ttl_s=60)])
    sessions = RedisSessions(client, keys, ttl_s=60)
    manager = CheckpointManager(store, sessions, fingerprint="m", dtype="float32", keys=keys)
    manager.save("acme", PROMPT[:300], _state(300), session_id="chat-1")
    entry = sessions.get("acme", "chat-1")
    assert entry is not None and entry.length == 300 and entry.tier == "redis"
    assert 0 < client.ttl(keys.session("acme", "chat-1")) <= 60
    lookup = manager.find("acme", PROMPT, session_id="chat-1")
    assert lookup.resume is not None and lookup.resume.length == 300
    assert sessions.delete("acme", "chat-1") and sessions.get("acme", "chat-1") is None


def test_without_a_grid_only_marks_and_sessions_are_candidates() -> None:
    manager = _manager(grid=0)
    assert manager.candidates(600, marks=[100], session_length=300) == [300, 100]


def test_a_session_checkpoint_that_is_not_a_prefix_counts_as_retokenized() -> None:
    """The previous reply re-tokenized differently: its checkpoint is skipped (counted), a shorter marked
    one is used."""
    sessions = MemorySessions()
    manager = CheckpointManager(TieredStore([MemoryTier()]), sessions, fingerprint="m", dtype="float32", keys=KEYS)
    generated = [*PROMPT[:100], 7, 7, 7]
    manager.save("acme", PROMPT[:100], _state(100))
    manager.save("acme", generated, _state(103), session_id="s1")
    retokenized = [*PROMPT[:100], 77, 7, 9, 9]
    lookup = manager.find("acme", retokenized, session_id="s1", marks=[100])
    assert lookup.resume is not None and lookup.resume.length == 100
    assert manager.counters.retokenized == 1 and sessions.retokenized[("acme", "s1")] == 1
    assert manager.find("acme", [*generated, 5], session_id="s1").resume is not None
    assert manager.counters.retokenized == 1


def test_retokenized_is_counted_in_the_redis_session_hash() -> None:
    fake_client = fakeredis.FakeRedis()
    sessions = RedisSessions(fake_client, KEYS, ttl_s=60)
    manager = CheckpointManager(TieredStore([MemoryTier()]), sessions, fingerprint="m", dtype="float32", keys=KEYS)
    manager.save("acme", PROMPT[:50], _state(50), session_id="s1")
    manager.find("acme", [1, *PROMPT[1:60]], session_id="s1")
    manager.find("acme", [2, *PROMPT[1:60]], session_id="s1")
    assert fake_client.hget(KEYS.session("acme", "s1"), "retokenized") == b"2"
    assert sessions.get("acme", "s1") is not None and fake_client.ttl(KEYS.session("acme", "s1")) > 0
