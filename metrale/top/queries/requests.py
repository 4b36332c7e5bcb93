"""The Requests panel: every request a worker runs now, from the running index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import redis

from metrale.shared.keys import Keys
from metrale.shared.record import RunningEntry
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
"""The length of each events list in ``KEYS``: one script instead of one pipelined ``LLEN`` per
request, which with 2,000 requests in flight cost ~50 ms in the client alone."""


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
    client: redis.Redis,
    keys: Keys,
    now: float,
    *,
    previous: RequestsView | None = None,
    limit: int = MAX_REQUESTS,
) -> RequestsView:
    """Two round trips: the index, then what it says of each request and each one's event count."""
    with client.pipeline(transaction=False) as pipe:
        pipe.zcard(keys.running_index())
        pipe.zrange(keys.running_index(), 0, limit - 1)
        total, indexed = pipe.execute()
    ids = [raw.decode() for raw in cast(list[bytes], indexed)]
    infos, counts = _read_entries(client, keys, ids)
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
    return RequestsView(now, tuple(rows), as_int(total))


def _read_entries(client: redis.Redis, keys: Keys, ids: list[str]) -> tuple[list[Any], list[Any]]:
    """What the index says of each request, and the length of each one's events list."""
    if not ids:
        return [], []
    script = client.register_script(_EVENT_COUNTS)
    with client.pipeline(transaction=False) as pipe:
        pipe.hmget(keys.running_info(), ids)
        script(keys=[keys.run_events(request_id) for request_id in ids], client=pipe)
        infos, counts = pipe.execute()
    return cast(list[Any], infos), cast(list[Any], counts)
