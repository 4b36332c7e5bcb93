"""Where a worker's heartbeat lives in Redis, written and withdrawn the same way by every writer.

A heartbeat is the hash ``met:worker:{wid}`` (field ``msg``: an encoded ``WorkerHeartbeat``) under
a TTL, and the worker's entry in the index ``met:workers`` scored by when it beat. A worker that stops
cleanly withdraws both; one that dies leaves its index entry behind its expired key, which is how a
reader (``met top``) tells a lost worker from one that never was, for ``LOST_WORKER_MEMORY_S``.
Writers take a pipeline, as in ``record.py`` (a cluster's too: the three keys share the control tag).
"""

from __future__ import annotations

from typing import TypeAlias

import redis.asyncio.cluster
import redis.cluster

from metrale.shared.codec import decode, encode
from metrale.shared.keys import LOST_WORKER_MEMORY_S, Keys
from metrale.shared.messages import WorkerHeartbeat
from metrale.shared.record import Pipeline

AnyPipeline: TypeAlias = Pipeline | redis.cluster.ClusterPipeline | redis.asyncio.cluster.ClusterPipeline
"""A pipeline of one Redis or of a cluster, sync or asyncio."""

HEARTBEAT_FIELD = "msg"
"""The field of ``met:worker:{wid}`` holding the encoded heartbeat."""


def queue_heartbeat(pipe: AnyPipeline, beat: WorkerHeartbeat, *, ttl_s: int, keys: Keys) -> None:
    """Queue on ``pipe``: write ``beat`` under a TTL of ``ttl_s``, index it, trim long-lost workers."""
    key = keys.worker(beat.worker_id)
    pipe.hset(key, HEARTBEAT_FIELD, encode(beat))
    pipe.expire(key, ttl_s)
    pipe.zadd(keys.worker_index(), {beat.worker_id: beat.sent_at})
    pipe.zremrangebyscore(keys.worker_index(), "-inf", beat.sent_at - LOST_WORKER_MEMORY_S)


def queue_withdrawal(pipe: AnyPipeline, worker_id: str, *, keys: Keys) -> None:
    """Queue on ``pipe``: remove the heartbeat and the index entry of a worker that stops cleanly."""
    pipe.delete(keys.worker(worker_id))
    pipe.zrem(keys.worker_index(), worker_id)


def parse_heartbeat(payload: bytes | None) -> WorkerHeartbeat | None:
    """The heartbeat in a ``msg`` field, or None when absent or not a heartbeat."""
    if payload is None:
        return None
    message = decode(payload)
    return message if isinstance(message, WorkerHeartbeat) else None
