"""``BatchStore`` on a real Redis (one, and a Redis Cluster, where the tenant's keys and the fleet-wide
active set lie in different slots): a batch's kept lines live only while it runs (found by the soak
benchmark: every finished batch left its answers in ``met:batch:{tenant}:{id}:results`` for ever), and
the active set holds exactly the unfinished batches."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest

from metrale.gateway.batches.batch_store import BatchStore, active_member
from metrale.gateway.batches.objects import Batch, BatchStatus
from metrale.shared.keys import Keys
from metrale.shared.redis_connect import AsyncClient, connect_async

pytestmark = pytest.mark.anyio

TENANT = "tenant-a"


@pytest.fixture
async def store(any_redis_url: str) -> AsyncIterator[tuple[BatchStore, AsyncClient, Keys]]:
    client = connect_async(any_redis_url)
    keys = Keys.for_redis(any_redis_url, f"met-test-{uuid.uuid4().hex[:12]}")
    yield BatchStore(client, keys), client, keys
    await client.aclose()


async def running_batch(store: BatchStore) -> str:
    batch_id = f"batch_{uuid.uuid4().hex[:12]}"
    batch = Batch(
        id=batch_id,
        endpoint="/v1/chat/completions",
        input_file_id="file-in",
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        created_at=int(time.time()),
    )
    await store.create(TENANT, batch)
    assert await store.move(TENANT, batch_id, BatchStatus.IN_PROGRESS, allowed_from={BatchStatus.VALIDATING})
    return batch_id


@pytest.mark.parametrize(
    ("steps", "final"),
    [
        ((BatchStatus.FINALIZING, BatchStatus.COMPLETED), BatchStatus.COMPLETED),
        ((BatchStatus.CANCELLING, BatchStatus.CANCELLED), BatchStatus.CANCELLED),
        ((BatchStatus.EXPIRED,), BatchStatus.EXPIRED),
    ],
    ids=["completed", "cancelled", "expired"],
)
async def test_the_move_to_a_terminal_status_deletes_the_kept_lines(
    store: tuple[BatchStore, AsyncClient, Keys], steps: tuple[BatchStatus, ...], final: BatchStatus
) -> None:
    batches, client, keys = store
    batch_id = await running_batch(batches)
    await batches.add_result(TENANT, batch_id, "a", '{"line": 1}', ok=True)
    await batches.add_result(TENANT, batch_id, "b", '{"line": 2}', ok=False)
    await batches.add_result(TENANT, batch_id, "a", '{"line": 1, "again": true}', ok=True)  # kept once
    assert await batches.results(TENANT, batch_id) == {"a": '{"line": 1}', "b": '{"line": 2}'}
    status = BatchStatus.IN_PROGRESS
    for step in steps:
        assert await batches.move(TENANT, batch_id, step, allowed_from={status}) is not None
        status = step
    assert status is final
    assert not await client.exists(keys.batch_results(TENANT, batch_id))
    ended = await batches.get(TENANT, batch_id)
    assert (ended.request_counts.completed, ended.request_counts.failed) == (1, 1)


async def test_a_line_kept_after_the_batch_ended_is_dropped_and_not_counted(
    store: tuple[BatchStore, AsyncClient, Keys],
) -> None:
    batches, client, keys = store
    batch_id = await running_batch(batches)
    await batches.add_result(TENANT, batch_id, "a", '{"line": 1}', ok=True)
    await batches.move(TENANT, batch_id, BatchStatus.FINALIZING, allowed_from={BatchStatus.IN_PROGRESS})
    await batches.move(TENANT, batch_id, BatchStatus.COMPLETED, allowed_from={BatchStatus.FINALIZING})
    await batches.add_result(TENANT, batch_id, "late", '{"line": 2}', ok=True)  # a runner that lost its lease
    assert not await client.exists(keys.batch_results(TENANT, batch_id))
    assert (await batches.get(TENANT, batch_id)).request_counts.completed == 1


async def test_the_active_set_holds_the_unfinished_batches_and_sheds_ended_ones(
    store: tuple[BatchStore, AsyncClient, Keys],
) -> None:
    batches, client, keys = store
    running, ending = await running_batch(batches), await running_batch(batches)
    assert await client.zcard(keys.active_batches()) == 2
    await batches.move(TENANT, ending, BatchStatus.CANCELLING, allowed_from={BatchStatus.IN_PROGRESS})
    await batches.move(TENANT, ending, BatchStatus.CANCELLED, allowed_from={BatchStatus.CANCELLING})
    assert await client.zrange(keys.active_batches(), 0, -1) == [active_member(TENANT, running).encode()]
    # A writer that died between the move and the active set's update left an ended batch in it.
    await client.zadd(keys.active_batches(), {active_member(TENANT, ending): 1.0})
    assert await batches.unfinished_reading(TENANT, "file-in") == running
    assert await client.zrange(keys.active_batches(), 0, -1) == [active_member(TENANT, running).encode()]
