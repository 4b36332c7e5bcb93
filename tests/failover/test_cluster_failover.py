"""A fleet on a real Redis Cluster (3 primaries + 3 replicas) loses the primary that holds a streaming
request's slot to ``kill -9`` mid-stream: its replica is promoted (``cluster-node-timeout`` 1 s), and every
stream still completes with exactly the tokens of an undisturbed run, none lost or repeated (issue #34).

The workers keep writing the other shards' transactions meanwhile; the dead shard's are retried on the
promoted replica, each written once (``redis_transport._write_shard``), and the relay's sharded subscription
follows its channel's slot (or, when the dead primary held the relay's channel, resubscribes and reads the
records)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale.worker.engine.factory import LoadedModel
from tests.failover.clients import RecordTap, stream_all
from tests.failover.cluster import ClusterGroup
from tests.failover.local_fleet import LocalFleet, completion_body, reference_tokens, text_of

pytestmark = pytest.mark.slow

REQUESTS = 16
PROMPT_TOKENS = 16
MAX_TOKENS = 48
KILL_AFTER_SHARE = 0.3
"""The kill comes once this share of all tokens is in the records."""
STREAMS_TIMEOUT_S = 180


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterGroup]:
    group = ClusterGroup(tmp_path / "cluster-nodes")
    (tmp_path / "cluster-nodes").mkdir()
    try:
        group.start()
        yield group
    finally:
        group.stop()


@pytest.fixture
def fleet(cluster: ClusterGroup, tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalFleet]:
    fleet = LocalFleet(cluster.url, tiny_model_dir, tmp_path)
    try:
        yield fleet
    finally:
        fleet.close()


def test_killing_the_primary_of_a_streaming_requests_slot_loses_no_token(
    cluster: ClusterGroup, fleet: LocalFleet, reference_model: LoadedModel
) -> None:
    fleet.start(["worker-1", "worker-2"])
    rng = random.Random(34)
    prompts = [[rng.randrange(20, 500) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]
    bodies = [completion_body(i, p, max_tokens=MAX_TOKENS, seeded=True) for i, p in enumerate(prompts)]
    tap = RecordTap(cluster.url, fleet.keys)
    killed: dict[str, str | int | float] = {}

    def kill_when_streaming() -> None:
        while tap.tokens_heard() < REQUESTS * MAX_TOKENS * KILL_AFTER_SHARE:
            time.sleep(0.01)
        streaming = [request_id for request_id, events in tap.snapshot().items() if not events[-1].finished]
        victim = streaming[0]
        killed["request"], killed["tokens_before"] = victim, len(tap.snapshot()[victim])
        killed["port"] = cluster.kill_primary_of(fleet.keys.run_record(victim))
        killed["at"] = time.monotonic()

    killer = threading.Thread(target=kill_when_streaming, daemon=True)
    killer.start()

    streams = asyncio.run(stream_all(fleet.base_url, bodies, STREAMS_TIMEOUT_S))

    killer.join(1)
    tap.close()
    assert "port" in killed, "the kill never came"
    victim_key = fleet.keys.run_record(str(killed["request"]))
    assert cluster.wait_for_promotion(victim_key, int(killed["port"])) >= 0
    assert all(s.done and not s.errors and s.finish_reasons == ["length"] for s in streams), (
        [s for s in streams if s.errors or not s.done][:3],
        fleet.logs(),
    )
    assert str(killed["request"]) in {s.request_id for s in streams}
    expected = reference_tokens(reference_model, bodies, [1000 + i for i in range(REQUESTS)])
    different = [
        f"{stream.request_id}: {stream.text!r} != {text_of(reference_model, body['prompt'], tokens)!r}"
        for stream, body, tokens in zip(streams, bodies, expected, strict=True)
        if stream.text != text_of(reference_model, body["prompt"], tokens)
    ]
    assert not different, different
