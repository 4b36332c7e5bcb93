"""Taking up to ``limit`` requests of one priority from every request shard, fairly (issue #34; for a Redis
Cluster, where each shard's stream lives in its own slot; ``redis_transport.py`` takes this way there).

A worker asks for no more entries than it can start soon, so the budget is split: each call gives the
shards ``limit // S`` entries each and one more to the first ``limit % S`` of them, the first shard
rotating with ``turn`` so no shard is always served first; budget left unused (a shard had fewer
entries) goes in further rounds to the shards that filled their share and to those not asked yet, then
to the ones that filled theirs again, so work waiting in one shard is taken while the budget lasts.
Each round is one pipeline of ``XREADGROUP`` s — on a cluster client, one round trip per node, whatever
``S`` is; at most ``ROUNDS``.
"""

from __future__ import annotations

from typing import Any

from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import Priority

ROUNDS = 3
"""Pipelined rounds at most per call: the split; what is left to the shards that filled their share and
those not asked yet (a budget smaller than the shard count); what is still left to the shards that
filled their share."""
Entry = tuple[str, bytes, dict[bytes, bytes]]
"""A taken entry: its stream, its id, its fields."""


def shares(limit: int, shards: int, turn: int) -> list[tuple[int, int]]:
    """``(shard, count)`` for each shard given a part of ``limit`` this turn, in serving order."""
    first = turn % shards
    order = [*range(first, shards), *range(first)]
    base, extra = divmod(limit, shards)
    return [
        (shard, base + (1 if position < extra else 0))
        for position, shard in enumerate(order)
        if base or position < extra
    ]


def take_from_shards(client: Any, keys: Keys, priority: Priority, consumer: str, limit: int, turn: int) -> list[Entry]:
    """Up to ``limit`` new entries of ``priority`` for ``consumer`` (group ``WORKER_GROUP``), from every
    shard; ``client`` is a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (binary replies)."""
    if limit < 1:
        return []
    streams = keys.request_streams(priority)
    order = [shard for shard, _ in shares(len(streams), len(streams), turn)]
    taken: list[Entry] = []
    asked = shares(limit, len(streams), turn)
    asked_before: set[int] = set()
    for round_index in range(ROUNDS):
        got = _read(client, consumer, [(streams[shard], count) for shard, count in asked])
        taken += got
        asked_before |= {shard for shard, _ in asked}
        left = limit - len(taken)
        filled = [shard for shard, count in asked if _count_from(got, streams[shard]) == count]
        candidates = filled  # shards known to hold more; before the last round, the ones not asked yet too
        if round_index < ROUNDS - 2:
            candidates = filled + [shard for shard in order if shard not in asked_before]
        if left < 1 or not candidates:
            break
        asked = [(candidates[position], count) for position, count in shares(left, len(candidates), 0)]
    return taken


def _read(client: Any, consumer: str, asks: list[tuple[str, int]]) -> list[Entry]:
    with client.pipeline(transaction=False) as pipe:
        for stream, count in asks:
            pipe.xreadgroup(WORKER_GROUP, consumer, {stream: ">"}, count=count)
        replies = pipe.execute()
    entries: list[Entry] = []
    for (stream, _), reply in zip(asks, replies, strict=True):
        for _name, stream_entries in reply or []:
            entries += [(stream, entry_id, fields) for entry_id, fields in stream_entries]
    return entries


def _count_from(entries: list[Entry], stream: str) -> int:
    return sum(1 for name, _, _ in entries if name == stream)
