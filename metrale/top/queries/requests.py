"""The Requests panel: every request a worker runs now, from the running index and their records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis

from metrale.shared.keys import Keys
from metrale.top.queries.replies import as_float, as_int, text

MAX_REQUESTS = 2000
"""The most requests one read shows (the longest running first)."""
_SHOWN = ("model", "tenant", "worker", "priority", "created_at")


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
    """Two round trips: the index, then each request's shown fields and event count."""
    with client.pipeline(transaction=False) as pipe:
        pipe.zcard(keys.running_index())
        pipe.zrange(keys.running_index(), 0, limit - 1, withscores=True)
        total, indexed = pipe.execute()
    indexed = cast(list[tuple[bytes, float]], indexed)
    ids = [raw.decode() for raw, _ in indexed]
    with client.pipeline(transaction=False) as pipe:
        for request_id in ids:
            pipe.hmget(keys.run_record(request_id), _SHOWN)
            pipe.llen(keys.run_events(request_id))
        replies = pipe.execute()
    before = {row.request_id: row for row in previous.rows} if previous is not None else {}
    rows = []
    for position, (request_id, (_, taken_at)) in enumerate(zip(ids, indexed, strict=True)):
        fields, tokens = replies[2 * position], as_int(replies[2 * position + 1])
        model, tenant, worker, priority, created = (text(value) for value in fields)
        if model is None:  # its record expired, or a worker of before the index wrote it
            continue
        rate = _rate(tokens, now, taken_at, before.get(request_id), previous.at if previous else None)
        age = now - as_float(created, taken_at)
        rows.append(
            RequestRow(request_id, model, tenant or "", worker or "", priority or "", tokens, rate, age, taken_at)
        )
    return RequestsView(now, tuple(rows), as_int(total))


def _rate(tokens: int, now: float, taken_at: float, before: RequestRow | None, then: float | None) -> float:
    if before is not None and then is not None and now > then and tokens >= before.tokens:
        return (tokens - before.tokens) / (now - then)
    elapsed = now - taken_at
    return tokens / elapsed if elapsed > 0 else 0.0
