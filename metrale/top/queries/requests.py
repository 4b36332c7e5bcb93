"""The Requests panel: every request a worker runs now, from the running index (one per request shard;
one on a single Redis)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from metrale.shared.keys import Keys
from metrale.shared.record import RunningEntry
from metrale.shared.redis_connect import SyncClient
from metrale.top.queries.replies import as_int

MAX_REQUESTS = 2000
"""The most requests one read shows (the longest running first)."""

_EVENT_COUNTS = """
local counts = {}
for i = 1, #KEYS do
  counts[i] = redis.call('LLEN', KEYS[i])
end
return counts
"""
"""The length of each events list in ``KEYS`` (one shard's: one slot): one script per shard instead of one
pipelined ``LLEN`` per request, which with 2,000 requests in flight cost ~50 ms in the client alone."""


@dataclass(frozen=True, slots=True)
class RequestRow:
    """One request in flight: where it runs, ``tokens`` emitted so far (its record's events: one per
    token and choice), ``tokens_per_s`` since the last read (or since taken, on the first), ``age_s``
    since the gateway created it."""

    request_id: str
    model: str
    tenant: str
    worker: str
    priority: str
    tokens: int
    tokens_per_s: float
    age_s: float
    taken_at: float


@dataclass(frozen=True, slots=True)
class RequestsView:
    """The requests read (at most ``MAX_REQUESTS`` of ``total`` in flight), oldest taken first."""

    at: float
    rows: tuple[RequestRow, ...]
    total: int

    def row(self, request_id: str) -> RequestRow | None:
        return next((row for row in self.rows if row.request_id == request_id), None)


def read_requests(
    client: SyncClient,
    keys: Keys,
    now: float,
    *,
    previous: RequestsView | None = None,
    limit: int = MAX_REQUESTS,
) -> RequestsView:
    """Two pipelined rounds (on a cluster, one round trip per node each): every shard's index, then
    what it says of each request and each one's event count."""
    with client.pipeline(transaction=False) as pipe:
        for shard in range(keys.shards):
            pipe.zcard(keys.running_index(shard))
            pipe.zrange(keys.running_index(shard), 0, limit - 1, withscores=True)
        replies = pipe.execute()
    total = sum(as_int(count) for count in replies[0::2])
    indexed = [
        (score, raw.decode(), shard)
        for shard, entries in enumerate(replies[1::2])
        for raw, score in cast(list[tuple[bytes, float]], entries)
    ]
    taken = sorted(indexed)[:limit]  # the longest running first, over every shard
    ids = [request_id for _, request_id, _ in taken]
    infos, counts = _read_entries(client, keys, [(request_id, shard) for _, request_id, shard in taken])
    before = {row.request_id: row.tokens for row in previous.rows} if previous is not None else {}
    since = now - previous.at if previous is not None else 0.0
    rows = []
    for request_id, info, count in zip(ids, infos, counts, strict=True):
        fields = RunningEntry.fields(info)
        if fields is None:  # finished between the two reads
            continue
        model, tenant, priority, worker, created_at, taken_at = fields
        tokens = int(count)
        earlier = before.get(request_id)
        if earlier is not None and since > 0 and tokens >= earlier:
            rate = (tokens - earlier) / since
        else:
            rate = tokens / (now - taken_at) if now > taken_at else 0.0
        age = now - created_at if now > created_at else 0.0
        rows.append(RequestRow(request_id, model, tenant, worker, priority, tokens, rate, age, taken_at))
    return RequestsView(now, tuple(rows), total)


def _read_entries(client: SyncClient, keys: Keys, taken: list[tuple[str, int]]) -> tuple[list[Any], list[Any]]:
    """What the index says of each request (``(id, shard)``), and the length of each one's events list,
    in ``taken``'s order: one ``HMGET`` and one script per shard, each over that shard's keys."""
    by_shard: dict[int, list[str]] = {}
    for request_id, shard in taken:
        by_shard.setdefault(shard, []).append(request_id)
    with client.pipeline(transaction=False) as pipe:
        for shard, ids in by_shard.items():
            pipe.hmget(keys.running_info(shard), ids)
            events = [keys.run_events(request_id) for request_id in ids]
            # EVAL by name: a cluster pipeline routes it by its keys, but blocks its ``eval`` method.
            pipe.execute_command("EVAL", _EVENT_COUNTS, len(events), *events)
        replies = pipe.execute()
    found: dict[str, tuple[Any, Any]] = {}
    for position, ids in enumerate(by_shard.values()):
        infos, counts = replies[2 * position], replies[2 * position + 1]
        found |= {request_id: (info, count) for request_id, info, count in zip(ids, infos, counts, strict=True)}
    return [found[request_id][0] for request_id, _ in taken], [found[request_id][1] for request_id, _ in taken]
