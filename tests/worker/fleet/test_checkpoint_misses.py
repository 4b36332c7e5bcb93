"""Every way a checkpoint can be unusable: the request is still served, with the same output as a
prefill from position 0, and the miss is counted under its reason."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from metrale.shared.keys import Keys
from metrale.shared.messages import GenerateRequest
from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.checkpoints.sessions import MemorySessions
from metrale.worker.checkpoints.store import MemoryTier, RedisTier, Tier, TieredStore
from metrale.worker.checkpoints.writer import CheckpointWriter
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.fleet.announcement import model_announcement
from metrale.worker.fleet.service import Worker
from metrale.worker.fleet.transport import InMemoryTransport
from tests.worker.worker_helpers import tokens_of, worker_settings

LIMITS = EngineLimits(max_seqs=4, max_batch_tokens=256, num_blocks=128, checkpoint_grid=64)
KEYS = Keys("met-test-misses")
TURN1 = list(range(100, 180))


class Rig:
    """One worker at a time over a shared checkpoint store, driven through an in-memory transport."""

    def __init__(self, model_dir: Path, tiers: list[Tier], fingerprint: str = "model-a") -> None:
        self.model_dir, self.store, self.sessions = model_dir, TieredStore(tiers), MemorySessions()
        self.fingerprint = fingerprint
        self.managers: list[CheckpointManager] = []

    def serve(self, message: GenerateRequest) -> list[int]:
        loaded = build_engine(self.model_dir, LIMITS)
        manager = CheckpointManager(
            self.store, self.sessions, fingerprint=self.fingerprint, dtype="float32", keys=KEYS, grid=64
        )
        self.managers.append(manager)
        transport = InMemoryTransport()
        announcement = model_announcement(loaded, "tiny")
        worker = Worker(
            loaded.engine,
            transport,
            worker_settings(),
            worker_id="w",
            model=announcement,
            checkpoints=CheckpointWriter(manager),
        )
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        transport.submit(message)
        deadline = time.monotonic() + 60
        while not transport.finished:
            assert time.monotonic() < deadline, "the request did not finish"
            time.sleep(0.01)
        stop.set()
        thread.join(30)
        return tokens_of(transport.events, 0)


def _request(request_id: str, prompt: list[int], tenant: str = "acme") -> GenerateRequest:
    return GenerateRequest(
        request_id,
        "tiny",
        tenant,
        prompt,
        max_tokens=8,
        temperature=0.7,
        seed=5,
        ignore_eos=True,
        session_id="conv",
    )


def _cold(model_dir: Path, prompt: list[int]) -> list[int]:
    from metrale.worker.engine.sampling_params import SamplingParams

    [result] = build_engine(model_dir, LIMITS).engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.7, seed=5, ignore_eos=True)
    )
    return result.completions[0].token_ids


def _flip_every_stored_byte(rig: Rig) -> None:
    memory = rig.store.tiers[0]
    assert isinstance(memory, MemoryTier)
    for key, data in list(memory._items.items()):
        memory.put(key, data[:-3] + bytes(b ^ 0x5A for b in data[-3:]))


def _evict_everything(rig: Rig) -> None:
    memory = rig.store.tiers[0]
    assert isinstance(memory, MemoryTier)
    for key in list(memory._items):
        memory.delete(key)


Breakage = Callable[[Rig], None]
CASES: dict[str, tuple[Breakage, str, str, bool]] = {
    # name: (what happens between the turns, miss reason, tenant of turn 2, does turn 2 edit the history)
    "flipped-bytes": (_flip_every_stored_byte, "checksum", "acme", False),
    "evicted": (_evict_everything, "evicted", "acme", False),
    "mismatched-token": (lambda rig: None, "token_mismatch", "acme", True),
    "other-tenant": (lambda rig: None, "none", "globex", False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unusable_checkpoint_is_a_counted_miss_and_changes_nothing(tiny_model_dir: Path, case: str) -> None:
    breakage, reason, tenant, edit = CASES[case]
    rig = Rig(tiny_model_dir, [MemoryTier()])
    reply = rig.serve(_request("t1", TURN1))
    breakage(rig)
    history = [*TURN1, *reply]
    if edit:
        history[5] += 1
    turn2 = [*history, *range(300, 320)]
    # The other tenant has no session of its own: give it the same session id, which is per tenant.
    assert rig.serve(_request("t2", turn2, tenant)) == _cold(tiny_model_dir, turn2)
    counters = rig.managers[-1].counters
    assert counters.hits == 0 and counters.misses == {reason: 1}


def test_changed_model_is_a_counted_miss(tiny_model_dir: Path) -> None:
    rig = Rig(tiny_model_dir, [MemoryTier()])
    reply = rig.serve(_request("t1", TURN1))
    memory = rig.store.tiers[0]
    assert isinstance(memory, MemoryTier)
    for key, data in list(memory._items.items()):  # the same keys, as if the weights changed under them
        memory.put(key.replace("model-a", "model-b"), data)
    rig.fingerprint = "model-b"
    turn2 = [*TURN1, *reply, *range(300, 320)]
    assert rig.serve(_request("t2", turn2)) == _cold(tiny_model_dir, turn2)
    assert rig.managers[-1].counters.misses == {"model_changed": 1}


def test_unreachable_redis_still_serves_and_counts_store_unavailable(tiny_model_dir: Path) -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.1, retry=Retry(NoBackoff(), 0))
    rig = Rig(tiny_model_dir, [RedisTier(dead)])
    reply = rig.serve(_request("t1", TURN1))
    assert reply == _cold(tiny_model_dir, TURN1)
    turn2 = [*TURN1, *reply, *range(300, 320)]
    assert rig.serve(_request("t2", turn2)) == _cold(tiny_model_dir, turn2)
    assert rig.managers[-1].counters.misses == {"store_unavailable": 1}


def test_intact_checkpoint_hits_for_contrast(tiny_model_dir: Path) -> None:
    rig = Rig(tiny_model_dir, [MemoryTier()])
    reply = rig.serve(_request("t1", TURN1))
    turn2 = [*TURN1, *reply, *range(300, 320)]
    assert rig.serve(_request("t2", turn2)) == _cold(tiny_model_dir, turn2)
    counters = rig.managers[-1].counters
    assert counters.hits == 1 and counters.tokens_reused == len(TURN1) + len(reply) - 1
