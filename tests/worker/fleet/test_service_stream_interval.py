"""A worker with ``stream_interval``: every request gets the tokens it gets without it, in fewer events
(its first at once, then every stream's held tokens together in each step numbered a multiple of the
interval), and every decode checkpoint it stores is of a state whose tokens its events have all carried
— what lets another worker that reads the record find that checkpoint."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from metrale.shared.keys import Keys
from metrale.shared.messages import GenerateRequest, TokenEvent
from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.checkpoints.sessions import MemorySessions
from metrale.worker.checkpoints.store import MemoryTier, TieredStore
from metrale.worker.checkpoints.writer import CheckpointWriter, SaveJob
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.fleet.announcement import model_announcement
from metrale.worker.fleet.service import Worker
from metrale.worker.fleet.transport import InMemoryTransport
from tests.worker.worker_helpers import join_worker, start_worker, tokens_of, worker_settings

DECODE_INTERVAL = 4
LIMITS = EngineLimits(max_seqs=4, max_batch_tokens=256, num_blocks=128, decode_checkpoint_interval=DECODE_INTERVAL)
PROMPT = list(range(100, 120))


class RecordingWriter(CheckpointWriter):
    """Notes how many output tokens each decode snapshot's state had consumed, per request."""

    def __init__(self, manager: CheckpointManager) -> None:
        super().__init__(manager)
        self.decode_outputs: dict[str, list[int]] = {}

    def submit(self, job: SaveJob) -> None:
        for snapshot in job.snapshots:
            if snapshot.decode:
                outputs = len(snapshot.consumed) - len(PROMPT)
                self.decode_outputs.setdefault(snapshot.request_id, []).append(outputs)
        super().submit(job)


def serve(
    model_dir: Path, messages: Sequence[GenerateRequest], interval: int, *, decode_checkpoints: bool = True
) -> tuple[InMemoryTransport, RecordingWriter]:
    limits = LIMITS if decode_checkpoints else dataclasses.replace(LIMITS, decode_checkpoint_interval=None)
    loaded = build_engine(model_dir, limits)
    manager = CheckpointManager(
        TieredStore([MemoryTier()]), MemorySessions(), fingerprint="m", dtype="float32", keys=Keys("met-si"), grid=0
    )
    writer = RecordingWriter(manager)
    transport = InMemoryTransport()
    settings = dataclasses.replace(worker_settings(), stream_interval=interval)
    worker = Worker(
        loaded.engine, transport, settings, worker_id="w", model=model_announcement(loaded, "tiny"), checkpoints=writer
    )
    stop = threading.Event()
    thread = start_worker(worker, stop)
    for message in messages:
        transport.submit(message)
    deadline = time.monotonic() + 60
    while len(transport.finished) < len(messages):
        assert time.monotonic() < deadline, "the requests did not finish"
        time.sleep(0.01)
    stop.set()
    join_worker(thread, stop)
    return transport, writer


def requests() -> list[GenerateRequest]:
    greedy = GenerateRequest("greedy", "tiny", "acme", PROMPT, max_tokens=19, ignore_eos=True, logprobs=2)
    sampled = GenerateRequest("sampled", "tiny", "acme", PROMPT[:7], max_tokens=23, temperature=0.9, seed=3, n=2)
    return [greedy, sampled]


def of(events: Sequence[TokenEvent], request_id: str) -> list[TokenEvent]:
    return [event for event in events if event.request_id == request_id]


def test_the_tokens_are_the_same_in_fewer_events(tiny_model_dir: Path) -> None:
    each, _ = serve(tiny_model_dir, requests(), interval=1, decode_checkpoints=False)
    grouped, _ = serve(tiny_model_dir, requests(), interval=5, decode_checkpoints=False)
    for message in requests():
        alone, together = of(each.events, message.request_id), of(grouped.events, message.request_id)
        for choice in range(message.n):
            assert tokens_of(together, choice) == tokens_of(alone, choice)
            sizes = [len(event.token_ids) for event in together if event.index == choice]
            assert sizes[0] == 1 and max(sizes) <= 5 and all(size == 5 for size in sizes[2:-1]), sizes
        assert [event.seq for event in together] == list(range(len(together)))
        assert len(together) < len(alone)
    greedy = of(grouped.events, "greedy")
    assert [lp for event in greedy for lp in event.logprobs or []] == [
        lp for event in of(each.events, "greedy") for lp in event.logprobs or []
    ]


def test_every_decode_checkpoint_is_of_tokens_already_sent(tiny_model_dir: Path) -> None:
    """At interval 6 with a decode checkpoint every 4 tokens, events would end after tokens 1, 7, 13, ...;
    each checkpoint's step sends what its request holds back, so they end after 5, 9, 13, ... as well."""
    transport, writer = serve(tiny_model_dir, requests()[:1], interval=6)
    events = of(transport.events, "greedy")
    sent, boundaries = 0, set()
    for event in events:
        sent += len(event.token_ids)
        boundaries.add(sent)
    snapshotted = writer.decode_outputs["greedy"]
    assert len(snapshotted) >= 3
    # The state after k output tokens is taken in the step that samples token k + 1: that step's events
    # end with it, so the record holds every token the state consumed (and the one it did not yet).
    assert {k + 1 for k in snapshotted} <= boundaries, (snapshotted, sorted(boundaries))


def test_streams_that_started_in_different_steps_send_in_the_same_steps(tiny_model_dir: Path) -> None:
    """The long prompt takes two prefill steps (256 tokens a step), so its first token comes a step after
    the short one's; from then on both requests' held tokens leave in the same writes."""
    short = GenerateRequest("short", "tiny", "acme", PROMPT, max_tokens=30, ignore_eos=True)
    long = GenerateRequest("long", "tiny", "acme", list(range(1, 301)), max_tokens=30, ignore_eos=True)
    transport, _ = serve(tiny_model_dir, [short, long], interval=4, decode_checkpoints=False)
    firsts = [
        next(i for i, (events, _) in enumerate(transport.publishes) if any(e.request_id == r for e in events))
        for r in ("short", "long")
    ]
    assert firsts[0] < firsts[1]
    carrying: dict[str, set[int]] = {"short": set(), "long": set()}
    for position, (events, _) in enumerate(transport.publishes):
        for event in events:
            if event.seq > 0 and not event.finished:
                carrying[event.request_id].add(position)
    assert carrying["short"] and carrying["short"] == carrying["long"]
