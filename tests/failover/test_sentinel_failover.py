"""A fleet on a Redis that fails over: real ``redis-server`` primary and replica, three ``redis-sentinel``
processes, a gateway and a worker reaching them through ``redis+sentinel://``. The primary is killed
with ``kill -9`` mid-stream; the sentinels promote the replica, and every stream completes with exactly
the tokens of an undisturbed run, its durable record holding each ``seq`` once, in order."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from metrale.shared.codec import decode
from metrale.shared.messages import TokenEvent
from metrale.shared.record import read_record
from metrale.shared.redis_connect import sync_client
from metrale.worker.engine.factory import LoadedModel
from tests.failover.clients import EventTap, stream_all
from tests.failover.local_fleet import LocalFleet, completion_body, reference_tokens, text_of
from tests.failover.sentinels import SentinelGroup

pytestmark = pytest.mark.slow

REQUESTS = 12
PROMPT_TOKENS = 16
MAX_TOKENS = 64
KILL_AFTER_SHARE = 0.3
"""The primary is killed once this share of all tokens has been streamed."""
STREAMS_TIMEOUT_S = 150


@pytest.fixture
def fleet(sentinels: SentinelGroup, tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalFleet]:
    fleet = LocalFleet(sentinels.url, tiny_model_dir, tmp_path, MET_REDIS_WAIT_REPLICAS="1")
    try:
        yield fleet
    finally:
        fleet.close()


@dataclass
class Failover:
    """When the primary was killed, how long the sentinels took to promote the replica, and how long
    until the fleet streamed again (the first token event heard after the kill)."""

    killed_at: float | None = None
    promotion_s: float | None = None
    recovery_s: float | None = None
    errors: list[BaseException] = field(default_factory=list)


def kill_primary_when(sentinels: SentinelGroup, tap: EventTap, tokens: int) -> tuple[threading.Thread, Failover]:
    failover = Failover()

    def kill() -> None:
        try:
            while tap.tokens_heard() < tokens:
                time.sleep(0.01)
            heard = tap.tokens_heard()
            failover.killed_at = time.monotonic()
            old = sentinels.kill_primary()
            failover.promotion_s = sentinels.wait_for_promotion(old)
            while tap.tokens_heard() == heard:
                time.sleep(0.01)
            failover.recovery_s = time.monotonic() - failover.killed_at
        except BaseException as error:
            failover.errors.append(error)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread, failover


def test_a_primary_killed_mid_stream_loses_no_stream_and_changes_no_token(
    fleet: LocalFleet, sentinels: SentinelGroup, reference_model: LoadedModel
) -> None:
    fleet.start(["worker-1"])
    rng = random.Random(18)
    prompts = [[rng.randrange(20, 500) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]
    bodies = [completion_body(i, p, max_tokens=MAX_TOKENS, seeded=i % 2 == 0) for i, p in enumerate(prompts)]
    tap = EventTap(sentinels.url, fleet.keys)
    killer, failover = kill_primary_when(sentinels, tap, int(REQUESTS * MAX_TOKENS * KILL_AFTER_SHARE))

    streams = asyncio.run(stream_all(fleet.base_url, bodies, STREAMS_TIMEOUT_S))

    killer.join(30)
    tap.close()
    assert not failover.errors, failover.errors
    assert failover.killed_at is not None and failover.recovery_s is not None, "the primary was not killed mid-stream"
    assert all(s.done and not s.errors and s.finish_reasons == ["length"] for s in streams), (
        [s for s in streams if s.errors or not s.done][:3],
        fleet.logs(),
    )
    client = sync_client(sentinels.url)
    records = [read_record(client, str(s.request_id), keys=fleet.keys) for s in streams]
    seeds = [record.seed if record is not None else -1 for record in records]
    expected = reference_tokens(reference_model, bodies, seeds)
    repeated = 0
    for stream, body, tokens in zip(streams, bodies, expected, strict=True):
        assert stream.text == text_of(reference_model, body["prompt"], tokens), f"{stream.request_id} differs"
        raw = client.lrange(fleet.keys.run_events(str(stream.request_id)), 0, -1)
        events = [decode(entry) for entry in raw]
        assert all(isinstance(event, TokenEvent) for event in events)
        by_seq: dict[int, TokenEvent] = {}
        for event in events:
            assert by_seq.setdefault(event.seq, event) == event, f"two different events with seq {event.seq}"
        repeated += len(events) - len(by_seq)
        assert sorted(by_seq) == list(range(len(by_seq))), f"{stream.request_id}: a seq is missing from its record"
        assert [t for seq in sorted(by_seq) for t in by_seq[seq].token_ids] == tokens
    client.close()
    assert fleet.gateway is not None
    refilled = fleet.gateway.log_path.read_text().count("events read from its record after a reconnect")
    print(
        f"\nfailover: promotion {failover.promotion_s:.2f} s, streaming again {failover.recovery_s:.2f} s "
        f"after the kill; {repeated} record entries written twice (a retried write); "
        f"{refilled} streams filled from their records after the gateway resubscribed"
    )
