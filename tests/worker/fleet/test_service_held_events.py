"""Final events held back for their checkpoint: the writer says when it stored one, and a worker with
nothing else to do waits for that, not for the request queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, TokenEvent
from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.checkpoints.sessions import MemorySessions
from metrale.worker.checkpoints.store import MemoryTier, TieredStore
from metrale.worker.checkpoints.writer import CheckpointWriter, SaveJob
from metrale.worker.engine.snapshots import Snapshot
from metrale.worker.fleet.service import Worker
from metrale.worker.fleet.transport import FinishedRequest, InMemoryTransport, Received
from tests.worker.worker_helpers import (
    announcement,
    expected_choice,
    generate_request,
    join_worker,
    make_engine,
    start_worker,
    tokens_of,
    wait_for,
    worker_settings,
)

KEYS = Keys("met-test-held-events")


class GatedTier(MemoryTier):
    """A memory tier whose ``put`` waits until ``gate`` is set; ``entered`` is set by the first put."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, key: str, data: bytes) -> None:
        self.entered.set()
        self.gate.wait()
        super().put(key, data)


class BlockLoggingTransport(InMemoryTransport):
    """Logs the ``block_ms`` of every ``receive``; sets ``stop`` once a request has finished."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__()
        self.stop = stop
        self.blocks: list[int] = []

    def receive(self, max_new: int, block_ms: int, *, max_interactive: int | None = None) -> list[Received]:
        self.blocks.append(block_ms)
        return super().receive(max_new, block_ms, max_interactive=max_interactive)

    def publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> None:
        super().publish(events, finished)
        if self.finished:
            self.stop.set()


def writer_over(tier: MemoryTier) -> CheckpointWriter:
    manager = CheckpointManager(TieredStore([tier]), MemorySessions(), fingerprint="f" * 8, dtype="float32", keys=KEYS)
    return CheckpointWriter(manager)


def final_job(request_id: str) -> SaveJob:
    snapshot = Snapshot(request_id, (5, 6, 7), {"kda": torch.zeros(2, 3)}, final=True)
    return SaveJob("acme", None, [snapshot], release=request_id)


def test_wait_released_returns_once_a_release_job_is_stored() -> None:
    tier = GatedTier()
    writer = writer_over(tier)
    try:
        assert not writer.wait_released(0.01)  # nothing submitted
        writer.submit(final_job("r1"))
        assert tier.entered.wait(5)
        assert not writer.wait_released(0.05) and writer.released() == []  # still being stored
        tier.gate.set()
        assert writer.wait_released(5)
        assert writer.released() == ["r1"]
        assert not writer.wait_released(0.01)  # drained by ``released``
    finally:
        tier.gate.set()
        writer.close()


def test_an_idle_worker_holding_final_events_polls_the_queue_without_blocking_and_sends_them_when_stored() -> None:
    stop = threading.Event()
    transport = BlockLoggingTransport(stop)
    tier = GatedTier()
    engine, _ = make_engine()
    worker = Worker(
        engine, transport, worker_settings(), worker_id="w1", model=announcement(), checkpoints=writer_over(tier)
    )
    message = generate_request("r1", session_id="s1")  # only a session keeps its final state
    transport.submit(message)
    thread = start_worker(worker, stop)
    try:
        wait_for(lambda: tier.entered.is_set() and not engine.has_unfinished(), "the request's final checkpoint")
        receives_before = len(transport.blocks)
        time.sleep(0.2)
        held = transport.blocks[receives_before:]
        assert transport.finished == []  # its final events wait for the checkpoint
        assert held and set(held) == {0}  # never blocked on the queue meanwhile
    finally:
        tier.gate.set()
    join_worker(thread, stop)

    tokens, reason = expected_choice(message, 0)
    assert tokens_of(transport.events, 0) == tokens
    assert [done.finish_reason for done in transport.finished] == [FinishReason(reason)]
