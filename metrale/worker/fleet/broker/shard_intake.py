"""Taking up to ``limit`` requests of one priority from every request shard, fairly (issue #34; for a Redis
Cluster, where each shard's stream lives in its own slot; ``redis_transport.py`` takes this way there).

A worker asks for no more entries than it can start soon, so the budget is split: each call gives the
shards ``limit // S`` entries each and one more to the first ``limit % S`` of them, the first shard
rotating with ``turn`` so no shard is always served first; budget left unused (a shard had fewer
entries) goes in further rounds to the shards that filled their share and to those not asked yet, then
to the ones that filled theirs again, so work waiting in one shard is taken while the budget lasts.
Each round is one pipeline of ``XREADGROUP`` s per node, whatever ``S`` is; at most ``ROUNDS``.

How a round reaches Redis is the caller's ``StreamReads``: ``pipelined_reads`` sends one pipeline on one
client (one Redis); ``node_reads`` groups the reads by the primary owning each stream's slot and sends
each group on that node's own connection. (Through redis-py's cluster pipeline every ``XREADGROUP`` first
costs a ``COMMAND GETKEYS`` round on one node, which finds its keys for it: ``XREADGROUP``'s keys follow
``STREAMS``, a position redis-py does not parse itself.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import Priority
from metrale.worker.fleet.broker.cluster_router import SlotRouter

ROUNDS = 3
"""Pipelined rounds at most per call: the split; what is left to the shards that filled their share and
those not asked yet (a budget smaller than the shard count); what is still left to the shards that
filled their share."""
Entry = tuple[str, bytes, dict[bytes, bytes]]
"""A taken entry: its stream, its id, its fields."""
StreamReads = Callable[[list[tuple[str, int]]], list[Entry]]
"""Reads ``(stream, count)`` asks for one consumer: up to ``count`` new entries of each stream."""


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


def take_from_shards(read: StreamReads, keys: Keys, priority: Priority, limit: int, turn: int) -> list[Entry]:
    """Up to ``limit`` new entries of ``priority`` from every shard, read by ``read`` (which names the
    consumer of group ``WORKER_GROUP``)."""
    if limit < 1:
        return []
    streams = keys.request_streams(priority)
    order = [shard for shard, _ in shares(len(streams), len(streams), turn)]
    taken: list[Entry] = []
    asked = shares(limit, len(streams), turn)
    asked_before: set[int] = set()
    for round_index in range(ROUNDS):
        got = read([(streams[shard], count) for shard, count in asked])
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


def pipelined_reads(client: Any, consumer: str) -> StreamReads:
    """Each round as one pipeline on ``client`` (a ``redis.Redis``, binary replies)."""
    return lambda asks: _read_on(client, consumer, asks)


def node_reads(router: SlotRouter, consumer: str) -> StreamReads:
    """Each round as one pipeline per primary, on that node's connection: the asks grouped by the node
    owning their stream's slot now. A node's group that fails (a ``MOVED`` reply, a lost node) is asked
    again as ``router`` retries, after the slot map is read again; the groups read already are not.
    (A group cut off after it ran leaves its entries pending for this consumer, which takes them back
    as its own orphans: ``reclaim.py``.)"""

    def read(asks: list[tuple[str, int]]) -> list[Entry]:
        entries: list[Entry] = []
        left = list(asks)

        def read_left() -> None:
            by_node: dict[int, tuple[Any, list[tuple[str, int]]]] = {}
            for stream, count in left:
                node = router.primary_for(stream)
                by_node.setdefault(id(node), (node, []))[1].append((stream, count))
            for node, node_asks in by_node.values():
                entries.extend(_read_on(node, consumer, node_asks))
                left[:] = [ask for ask in left if ask not in node_asks]

        router.call(read_left)
        order = {stream: position for position, (stream, _) in enumerate(asks)}
        return sorted(entries, key=lambda entry: order[entry[0]])  # stable: a stream's entries in order

    return read


def _read_on(client: Any, consumer: str, asks: list[tuple[str, int]]) -> list[Entry]:
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
