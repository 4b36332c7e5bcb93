"""A client that leaves mid-stream frees its worker slot within one engine step.

The gateway turns the disconnect into a ``CancelRequest`` on the cancel channel; this test listens
there too. The worker applies cancels before each step, so once the cancel has reached Redis the
request may emit at most the one token of the step already running, then ends with ``abort``; the
worker's next heartbeats show the slot free again.
"""

from __future__ import annotations

import json
import time
from typing import cast

import httpx
import pytest
import redis
import redis.cluster

from metrale.gateway.streams.generation import CLIENT_GONE
from metrale.shared.codec import decode
from metrale.shared.messages import CancelRequest, FinishReason, WorkerHeartbeat
from metrale.shared.record import RunRecord, RunStatus, read_record
from metrale.shared.redis_connect import is_cluster
from tests.integration.deployments import HEARTBEAT_TTL_S, MAX_SEQS, Fleet
from tests.integration.polling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.redis]

CHUNKS_BEFORE_LEAVING = 5
MAX_TOKENS = 8000
"""Far more than the test waits for: the request is still running when the client leaves."""


def heartbeat_after(client: redis.Redis, fleet: Fleet, moment: float) -> WorkerHeartbeat:
    """The worker's first heartbeat sent after ``moment`` (unix time)."""

    def probe() -> WorkerHeartbeat | None:
        raw = cast(bytes | None, client.hget(fleet.keys.worker(fleet.worker_id), "msg"))
        beat = decode(raw) if raw is not None else None
        return beat if isinstance(beat, WorkerHeartbeat) and beat.sent_at > moment else None

    return wait_for(probe, "a fresh heartbeat", timeout_s=3 * HEARTBEAT_TTL_S)


def finished_record(client: redis.Redis, fleet: Fleet, request_id: str) -> RunRecord:
    def probe() -> RunRecord | None:
        record = read_record(client, request_id, keys=fleet.keys)
        return record if record is not None and record.status is RunStatus.FINISHED else None

    return wait_for(probe, f"{request_id} to finish")


def test_a_client_leaving_mid_stream_frees_its_slot_within_one_step(
    any_fleet: Fleet, any_fleet_redis: redis.Redis
) -> None:
    """On one Redis and on a Redis Cluster (``any_fleet``: there the cancel is sharded pub/sub)."""
    fleet, fleet_redis = any_fleet, any_fleet_redis
    cancels = fleet_redis.pubsub(ignore_subscribe_messages=True)
    if is_cluster(fleet_redis):
        cancels.ssubscribe(fleet.keys.cancel_channel())
    else:
        cancels.subscribe(fleet.keys.cancel_channel())
    body = {"model": fleet.endpoint.model, "prompt": [11, 12, 13, 14], "max_tokens": MAX_TOKENS, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    http = httpx.Client(base_url=fleet.endpoint.base_url, headers=fleet.endpoint.headers, timeout=30)
    with http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        chunks = [json.loads(next(events).removeprefix("data: ")) for _ in range(CHUNKS_BEFORE_LEAVING)]
        busy = heartbeat_after(fleet_redis, fleet, time.time())
    # Leaving the block closed the connection with the stream unread: the client is gone.

    request_id = chunks[0]["id"]
    cancel = wait_for(lambda: _next_cancel(cancels), "the gateway's cancel")
    at_cancel = read_record(fleet_redis, request_id, keys=fleet.keys)
    record = finished_record(fleet_redis, fleet, request_id)
    idle = heartbeat_after(fleet_redis, fleet, time.time())
    cancels.close()

    assert (cancel.request_id, cancel.reason) == (request_id, CLIENT_GONE)
    assert at_cancel is not None
    tokens_after_cancel = len(record.token_ids()) - len(at_cancel.token_ids())
    assert tokens_after_cancel <= 1, f"the worker ran {tokens_after_cancel} steps after the cancel"
    assert record.finish_reason is FinishReason.ABORT and record.is_contiguous
    final = record.events[-1]
    assert final.finished and final.token_ids == [] and final.finish_reason is FinishReason.ABORT
    assert final.usage is not None and final.usage.completion_tokens == len(record.token_ids()) < MAX_TOKENS
    assert (busy.running, busy.free_slots) == (1, MAX_SEQS - 1)
    assert (idle.running, idle.waiting, idle.free_slots) == (0, 0, MAX_SEQS)


def _next_cancel(listener: redis.client.PubSub) -> CancelRequest | None:
    if isinstance(listener, redis.cluster.ClusterPubSub):
        message = listener.get_sharded_message(ignore_subscribe_messages=True, timeout=0.05)
    else:
        message = listener.get_message(timeout=0.05)
    if message is None or message["type"] not in ("message", "smessage"):
        return None
    cancel = decode(message["data"])
    assert isinstance(cancel, CancelRequest), cancel
    return cancel
