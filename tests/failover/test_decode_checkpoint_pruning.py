"""The checkpoint writer keeps one decode checkpoint per request: the newest, until the request ends."""

from __future__ import annotations

import torch

from metrale.shared.keys import Keys
from metrale.worker.checkpoints.hashing import PrefixHasher
from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.checkpoints.sessions import MemorySessions
from metrale.worker.checkpoints.store import MemoryTier, TieredStore
from metrale.worker.checkpoints.writer import CheckpointWriter, SaveJob
from metrale.worker.engine.snapshots import Snapshot

KEYS = Keys("met-test-pruning")
TOKENS = tuple(range(100, 140))


def snapshot(length: int, *, decode: bool = False, final: bool = False) -> Snapshot:
    state = {"kda": torch.full((2, 3), float(length))}
    return Snapshot("r1", TOKENS[:length], state, final=final, decode=decode)


def stored_lengths(manager: CheckpointManager) -> list[int]:
    """The prefix lengths of ``TOKENS`` with a checkpoint in the store."""
    hasher = PrefixHasher(TOKENS)
    keys = {n: KEYS.checkpoint(manager.fingerprint, "acme", hasher(n)) for n in range(1, len(TOKENS) + 1)}
    return [n for n, key in keys.items() if manager.store.get(key) is not None]


def written(jobs: list[SaveJob], forget: bool = False) -> CheckpointManager:
    manager = CheckpointManager(
        TieredStore([MemoryTier()]), MemorySessions(), fingerprint="f" * 8, dtype="float32", keys=KEYS
    )
    writer = CheckpointWriter(manager)
    for job in jobs:
        writer.submit(job)
    if forget:
        writer.forget("acme", "r1")
    writer.close()
    return manager


def job(*snapshots: Snapshot) -> SaveJob:
    return SaveJob("acme", None, snapshots, release=None)


def test_a_newer_decode_checkpoint_replaces_the_one_before() -> None:
    manager = written([job(snapshot(8)), job(snapshot(20, decode=True)), job(snapshot(28, decode=True))])

    assert stored_lengths(manager) == [8, 28]  # the prompt checkpoint stays


def test_the_last_decode_checkpoint_goes_when_the_request_ends() -> None:
    finished = written([job(snapshot(20, decode=True)), job(snapshot(33, final=True))])
    aborted = written([job(snapshot(20, decode=True))], forget=True)

    assert stored_lengths(finished) == [33]
    assert stored_lengths(aborted) == []
