"""Issue #18's acceptance for admission control: 300 concurrent streams against one tiny worker with
``MET_MAX_QUEUE_WAIT_S=5``. The excess is refused at once with ``Retry-After``; the streams taken
are taken by the worker within the bound (plus the estimate's slack on a loaded machine); the
official client, retrying by itself, completes every one. ``bench/admission.py`` measures the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.admission import QueueWaits, await_slot_times, burst, percentile, retried_burst, slot_counters
from tests.integration.deployments import HEARTBEAT_TTL_S, Fleet, running_fleet

pytestmark = [pytest.mark.slow, pytest.mark.redis]

STREAMS = 300
SLOTS = 8
MAX_TOKENS = 512
"""Few slots and long enough requests that even a fast machine cannot start 300 within 5 s (at 32
tokens a quiet 2-core machine started 293 of them; at 128, once the tiny model's decode step became one
C call, a wave of 8 took 0.16 s and 300 streams would all have started within ~6 s, too close to the
bound for the last check below to mean anything)."""
MAX_WAIT_S = 5.0


@pytest.fixture(scope="module")
def bounded_fleet(fleet_redis_url: str, model_settings: dict[str, str], integration_dir: Path) -> Iterator[Fleet]:
    """A worker of ``SLOTS`` slots and a gateway refusing what could not start within ``MAX_WAIT_S``."""
    settings = {**model_settings, "MET_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S), "MET_MAX_QUEUE_WAIT_S": str(MAX_WAIT_S)}
    worker_args = ["--max-seqs", str(SLOTS), "--num-blocks", "1024"]
    with running_fleet(
        fleet_redis_url, integration_dir, settings=settings, worker_args=worker_args, worker_id="bounded-worker"
    ) as running:
        yield running


def test_a_burst_of_300_streams_is_shed_at_once_and_completed_by_client_retries(bounded_fleet: Fleet) -> None:
    endpoint, url, namespace = bounded_fleet.endpoint, bounded_fleet.redis_url, bounded_fleet.keys.namespace
    run = (endpoint.base_url, endpoint.api_key, endpoint.model)
    began = time.perf_counter()
    warm_up = asyncio.run(burst(*run, SLOTS, MAX_TOKENS))  # one full wave: the slots' turnover is measured
    wave_s = time.perf_counter() - began
    assert all(attempt.status == 200 and attempt.completed for attempt in warm_up)
    await_slot_times(url, namespace, SLOTS)
    before = slot_counters(url, namespace)

    with QueueWaits(url, namespace) as sampled:
        attempts = asyncio.run(burst(*run, STREAMS, MAX_TOKENS))

    refused = [attempt for attempt in attempts if attempt.status == 429]
    accepted = [attempt for attempt in attempts if attempt.status == 200]
    assert len(refused) + len(accepted) == STREAMS, sorted({attempt.status for attempt in attempts})
    # The tiny worker starts some tens of the 300 within the bound (docs/BENCHMARKS.md had 60–100 at 128 tokens).
    assert len(refused) >= 10 and len(accepted) >= SLOTS, (len(refused), len(accepted))
    assert all(attempt.completed for attempt in accepted)
    assert all(attempt.retry_after is not None and int(attempt.retry_after) >= 1 for attempt in refused)
    # Refused as the gateway reads them, not after waiting for capacity: sooner than the streams taken
    # get their first token. (On CI's two loaded cores one gateway takes seconds to read a burst of
    # 300, and the client as long to send it; docs/BENCHMARKS.md has the figures.)
    refusal_s = [attempt.headers_s for attempt in refused]
    ttft_s = [attempt.headers_s for attempt in accepted]
    assert percentile(refusal_s, 0.5) < percentile(ttft_s, 0.5), (percentile(refusal_s, 0.5), percentile(ttft_s, 0.5))
    assert percentile(refusal_s, 0.99) < MAX_WAIT_S + 2 * wave_s, (percentile(refusal_s, 0.99), wave_s)
    waits = list(sampled.waits.values())
    assert len(waits) == len(accepted)
    # What the bound promises: taken by the worker within it, as far as the slots turn over as fast
    # as they did before the burst. On a shared CPU the burst itself slows the worker (the gateway
    # reading it takes cores the worker had): that drift, measured, scales the bound; a wave more
    # for a step and the gaps between a slot's requests. Without the bound the last would wait for
    # 300 / SLOTS waves.
    await_slot_times(url, namespace, SLOTS + len(accepted))
    after = slot_counters(url, namespace)
    assert before is not None and after is not None
    drift = max(1.0, (after[1] - before[1]) / (after[0] - before[0]) / (before[1] / before[0]))
    wait_p99 = percentile(waits, 0.99)
    assert wait_p99 <= MAX_WAIT_S * drift + 3 * wave_s, (wait_p99, drift, wave_s)
    assert wait_p99 < (STREAMS / SLOTS - 1) * wave_s / 2, (wait_p99, wave_s)

    retried = asyncio.run(retried_burst(*run, STREAMS, MAX_TOKENS))
    assert (retried.completed, retried.failed) == (STREAMS, 0)
