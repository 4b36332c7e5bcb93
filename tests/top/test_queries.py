"""Each panel's query against a real Redis fed by the fake fleet, at a pinned moment: one Redis, and a
Redis Cluster (whose key space spreads the requests over 12 shards)."""

from __future__ import annotations

import dataclasses

import pytest
import redis

from metrale.shared.keys import Keys
from metrale.shared.messages import Priority
from metrale.top.queries.batches import read_batches
from metrale.top.queries.counters import read_counters
from metrale.top.queries.fleet import RowState, read_fleet
from metrale.top.queries.queues import read_queues
from metrale.top.queries.requests import read_requests
from metrale.top.queries.snapshot import read_snapshot
from tests.top.conftest import NOW
from tests.top.fake_fleet import FakeFleet


@pytest.fixture
def redis_url(any_redis_url: str) -> str:
    return any_redis_url


def test_fleet_rows_live_workers_by_id_then_the_lost(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    view = read_fleet(client, keys, NOW)
    assert [(row.worker_id, row.state) for row in view.workers] == [
        ("cpu-c", RowState.DRAINING),
        ("gpu-a", RowState.TAKING),
        ("gpu-b", RowState.TAKING),
        ("gpu-d", RowState.LOST),
    ]
    gpu_b = view.worker("gpu-b")
    assert gpu_b is not None and gpu_b.heartbeat is not None
    assert (gpu_b.heartbeat.device, gpu_b.heartbeat.used_slots, gpu_b.heartbeat_age_s(NOW)) == ("cuda:1", 2, 2.5)
    lost = view.worker("gpu-d")
    assert lost is not None and lost.heartbeat is None and lost.heartbeat_age_s(NOW) == 45.0
    assert view.tokens_per_s == pytest.approx(812.4 + 640.0 + 31.0)


def test_a_worker_that_stopped_cleanly_is_gone(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    scene.stopped_worker("gpu-b")
    assert [row.worker_id for row in read_fleet(client, keys, NOW).workers] == ["cpu-c", "gpu-a", "gpu-d"]


def test_queues_depth_pending_oldest_wait_dead_letters_and_429s(
    scene: FakeFleet, client: redis.Redis, keys: Keys
) -> None:
    view = read_queues(client, keys, NOW)
    interactive, batch = view.queues
    assert (interactive.priority, interactive.length, interactive.pending, interactive.waiting) == (
        Priority.INTERACTIVE,
        6,
        4,
        2,
    )
    assert interactive.oldest_waiting_s == pytest.approx(7.5, abs=0.002)
    assert (batch.length, batch.pending, batch.waiting) == (2, 1, 1)
    assert batch.oldest_waiting_s == pytest.approx(33.0, abs=0.002)
    assert (view.dead_letters, view.rejected, view.waiting) == (1, 17, 3)


def test_queues_of_a_fleet_no_worker_has_opened_yet_are_empty(client: redis.Redis, keys: Keys) -> None:
    view = read_queues(client, keys, NOW)
    assert [(row.length, row.pending, row.oldest_waiting_s) for row in view.queues] == [(0, 0, None), (0, 0, None)]
    assert (view.dead_letters, view.rejected) == (0, 0)


def test_requests_in_flight_with_where_they_run_and_their_pace(
    scene: FakeFleet, client: redis.Redis, keys: Keys
) -> None:
    view = read_requests(client, keys, NOW)
    assert view.total == 5
    assert [row.request_id for row in view.rows] == ["batch-1", "chat-4", "chat-2", "chat-1", "chat-3"]  # oldest taken
    chat_4 = view.row("chat-4")
    assert chat_4 is not None
    assert (chat_4.model, chat_4.tenant, chat_4.worker, chat_4.priority) == (
        "kimi-small",
        "globex",
        "gpu-b",
        "interactive",
    )
    assert (chat_4.tokens, chat_4.tokens_per_s, chat_4.age_s) == (300, pytest.approx(6.0), pytest.approx(60.0))

    scene.emit("chat-4", "gpu-b", 20, first_seq=300)
    later = read_requests(client, keys, NOW + 2.0, previous=view)
    chat_4 = later.row("chat-4")
    assert chat_4 is not None and (chat_4.tokens, chat_4.tokens_per_s) == (
        320,
        pytest.approx(10.0),
    )  # since the last read
    scene.finish("chat-4")
    assert read_requests(client, keys, NOW + 3.0, previous=later).row("chat-4") is None


def test_requests_read_at_most_the_limit_but_count_them_all(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    view = read_requests(client, keys, NOW, limit=2)
    assert ([row.request_id for row in view.rows], view.total) == (["batch-1", "chat-4"], 5)


def test_counters_hit_rate_and_misses_by_reason(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    view = read_counters(client, keys)
    assert (view.lookups, view.hits, view.hit_rate, view.tokens_reused) == (40, 30, 0.75, 51200)
    assert view.misses == {"none": 8, "token_mismatch": 2}
    assert view.failover == {"resumed_requests": 3, "handed_back_requests": 5, "unresumable_requests": 1}


def test_batches_with_their_counts_and_eta(
    scene: FakeFleet, client: redis.Redis, keys: Keys, real_redis_url: str
) -> None:
    jobs = redis.Redis.from_url(real_redis_url)  # RQ's Redis: the fleet's own, or beside a cluster
    view = read_batches(client, keys, jobs=jobs)
    jobs.close()
    abc, xyz = view.batches
    assert (abc.tenant, abc.batch_id, abc.status, abc.total, abc.done) == ("acme", "batch_abc", "in_progress", 200, 52)
    assert abc.eta_s(NOW) == pytest.approx(100.0 / 52 * 148)
    assert xyz.eta_s(NOW) is None  # nothing done yet: no pace to go by
    assert (view.queued_jobs, view.running_jobs) == (0, 0)


def test_a_snapshot_is_every_panel_read_at_one_moment(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    first = read_snapshot(client, keys, NOW)
    second = read_snapshot(client, keys, NOW + 1.0, previous=first)
    assert second.at == NOW + 1.0 and len(second.fleet.workers) == 4 and len(second.batches.batches) == 2
    assert all(row.tokens_per_s == 0.0 for row in second.requests.rows)  # nothing emitted in between
    assert dataclasses.replace(second.counters) == first.counters


def test_a_cluster_without_a_jobs_redis_shows_no_job_counts(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    view = read_batches(client, keys)
    if keys.shards > 1:
        assert (view.queued_jobs, view.running_jobs) == (None, None)
    else:  # one Redis holds RQ's queue too
        assert (view.queued_jobs, view.running_jobs) == (0, 0)
    assert len(view.batches) == 2
