"""``met top --once``: the same panels printed once as rich tables (plain text without a terminal)."""

from __future__ import annotations

from rich.console import Console

from metrale.top.queries.snapshot import Snapshot
from metrale.top.tables import (
    FLEET_COLUMNS,
    REQUEST_COLUMNS,
    batches_table,
    clock_time,
    counters_table,
    fleet_rows,
    queues_table,
    request_rows,
    table,
)

MAX_PRINTED_REQUESTS = 50
"""The most requests ``--once`` prints (the oldest first); the caption says how many there are."""


def render(
    snapshot: Snapshot, console: Console, *, label: str = "", text: str = "", max_requests: int = MAX_PRINTED_REQUESTS
) -> None:
    """Print every panel of ``snapshot``; ``text`` filters the requests by model or tenant."""
    fleet = snapshot.fleet
    where = f" · {label}" if label else ""
    console.print(f"met top{where} · {clock_time(snapshot.at)}")
    live = sum(1 for row in fleet.workers if row.heartbeat is not None)
    caption = f"fleet {fleet.tokens_per_s:,.1f} tok/s · {live} live of {len(fleet.workers)}"
    console.print(table("Fleet", FLEET_COLUMNS, fleet_rows(fleet, snapshot.at), caption=caption))
    for panel in (queues_table(snapshot.queues), counters_table(snapshot.counters)):
        panel.expand = False
        console.print(panel)
    batches = batches_table(snapshot.batches, snapshot.at)
    batches.expand = False
    console.print(batches)
    rows = request_rows(snapshot.requests, sort="age", text=text)
    shown = rows[:max_requests]
    caption = f"{len(shown)} shown of {snapshot.requests.total} in flight" + (f" (filter '{text}')" if text else "")
    console.print(table("Requests in flight", REQUEST_COLUMNS, shown, caption=caption))
