"""The panels as text: the rows and rich tables both the Textual app and ``--once`` show.

Pure functions of the query results and ``now``; formatting lives here and nowhere else.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from rich import box
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from metrale.top.queries.batches import BatchesView
from metrale.top.queries.counters import CountersView
from metrale.top.queries.fleet import FleetView, RowState, WorkerRow
from metrale.top.queries.queues import QueuesView
from metrale.top.queries.requests import RequestRow, RequestsView

Row = tuple[str, tuple[str, ...]]
"""A table row: its key (a worker or request id) and its cells."""

FLEET_COLUMNS = (
    "worker",
    "model",
    "device",
    "state",
    "run",
    "wait",
    "swap",
    "slots",
    "blocks",
    "tok/s",
    "accept",
    "step",
    "beat",
)
REQUEST_COLUMNS = ("request", "model", "tenant", "worker", "tokens", "tok/s", "age", "prio")
REQUEST_SORTS: dict[str, Callable[[RequestRow], Any]] = {
    "age": lambda row: -row.age_s,
    "tok/s": lambda row: -row.tokens_per_s,
    "tokens": lambda row: -row.tokens,
    "worker": lambda row: row.worker,
    "model": lambda row: row.model,
    "tenant": lambda row: row.tenant,
    "prio": lambda row: row.priority,
    "request": lambda row: row.request_id,
}
"""What ``s`` cycles through: the column the requests are sorted by (numbers largest first)."""
STATE_STYLES = {RowState.TAKING: "green", RowState.DRAINING: "yellow", RowState.LOST: "bold red"}


def duration(seconds: float | None) -> str:
    """``7.5s``, ``3m04s``, ``2h05m``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def clock_time(at: float) -> str:
    """The UTC time of day of a unix moment."""
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def matches(row: RequestRow, text: str) -> bool:
    """Whether a request's model or tenant contains ``text`` (case-insensitive; empty matches all)."""
    needle = text.strip().lower()
    return not needle or needle in row.model.lower() or needle in row.tenant.lower()


def fleet_rows(view: FleetView, now: float) -> list[Row]:
    return [(row.worker_id, _fleet_cells(row, now)) for row in view.workers]


def _fleet_cells(row: WorkerRow, now: float) -> tuple[str, ...]:
    beat, age = row.heartbeat, duration(row.heartbeat_age_s(now))
    if beat is None:
        return (row.worker_id, "-", "-", row.state.value, *("-",) * 8, age)
    slots = f"{beat.used_slots}/{beat.total_slots}" if beat.used_slots is not None else f"{beat.free_slots} free"
    blocks = f"{beat.used_blocks}/{beat.total_blocks}" if beat.used_blocks is not None else f"{beat.free_blocks} free"
    step = f"{beat.step_time_s * 1000:.0f}ms" if beat.step_time_s else "-"
    acceptance = f"{beat.acceptance:.0%}" if beat.acceptance is not None else "-"
    counts = (str(beat.running), str(beat.waiting), str(beat.swapped))
    return (
        row.worker_id,
        beat.model,
        beat.device or "-",
        row.state.value,
        *counts,
        slots,
        blocks,
        f"{beat.tokens_per_s:,.1f}",
        acceptance,
        step,
        age,
    )


def request_rows(view: RequestsView, *, sort: str = "age", text: str = "", worker: str | None = None) -> list[Row]:
    """The requests matching ``text`` (and running on ``worker``, if given), sorted by ``sort``."""
    shown = [row for row in view.rows if matches(row, text) and (worker is None or row.worker == worker)]
    shown.sort(key=REQUEST_SORTS[sort])
    return [(row.request_id, _request_cells(row)) for row in shown]


def _request_cells(row: RequestRow) -> tuple[str, ...]:
    return (
        row.request_id,
        row.model,
        row.tenant,
        row.worker,
        f"{row.tokens:,}",
        f"{row.tokens_per_s:,.1f}",
        duration(row.age_s),
        row.priority,
    )


def table(title: str, columns: tuple[str, ...], rows: list[Row], *, caption: str | None = None) -> Table:
    """A rich table of ``rows`` (what ``--once`` prints for a DataTable panel)."""
    shown = Table(title=title, caption=caption, title_justify="left", caption_justify="left", expand=False)
    for column in columns:
        shown.add_column(
            column,
            justify="left"
            if column in ("worker", "model", "device", "state", "request", "tenant", "prio")
            else "right",
        )
    for _, cells in rows:
        shown.add_row(*cells)
    return shown


def queues_table(view: QueuesView) -> Table:
    shown = Table(title="Queues", title_justify="left", expand=True, box=box.SIMPLE_HEAD)
    shown.add_column("queue", min_width=11, no_wrap=True)
    for column in ("waiting", "pending", "length", "oldest"):
        shown.add_column(column, justify="right")
    for row in view.queues:
        cells = (str(row.waiting), str(row.pending), str(row.length), duration(row.oldest_waiting_s))
        shown.add_row(row.priority.value, *cells)
    shown.add_row(Text("dead", style="dim"), str(view.dead_letters), "", "", "", style="dim")
    shown.add_row(Text("429s", style="dim"), str(view.rejected), "", "", "", style="dim")
    return shown


def counters_table(view: CountersView) -> Table:
    shown = Table(
        title="Checkpoints and failover", title_justify="left", expand=True, show_header=False, box=box.SIMPLE
    )
    shown.add_column("what")
    shown.add_column("count", justify="right")
    rate = f"{view.hit_rate:.0%}" if view.hit_rate is not None else "-"
    shown.add_row("lookups", f"{view.lookups:,}")
    shown.add_row("hit rate", f"{rate} ({view.hits:,})")
    shown.add_row("tokens reused", f"{view.tokens_reused:,}")
    for reason, count in view.misses.items():
        shown.add_row(Text(f"  miss: {reason}", style="dim"), f"{count:,}")
    for name in ("resumed_requests", "handed_back_requests", "unresumable_requests"):
        shown.add_row(name.removesuffix("_requests").replace("_", " "), f"{view.failover.get(name, 0):,}")
    return shown


def batches_table(view: BatchesView, now: float, *, bar_width: int = 10) -> Table:
    if view.queued_jobs is None or view.running_jobs is None:
        caption = "jobs: no job queue Redis (MET_JOBS_REDIS_URL)"
    else:
        caption = f"jobs: {view.queued_jobs} queued, {view.running_jobs} running"
    shown = Table(
        title="Batches", caption=caption, title_justify="left", caption_justify="left", expand=True, box=box.SIMPLE_HEAD
    )
    shown.add_column("batch", no_wrap=True, min_width=16)
    shown.add_column("progress", no_wrap=True)
    for column in ("done", "failed", "eta"):
        shown.add_column(column, justify="right", no_wrap=True)
    if not view.batches:
        shown.add_row(Text("no active batch", style="dim"), "", "", "", "")
    for batch in view.batches:
        bar = ProgressBar(total=max(batch.total, 1), completed=batch.done, width=bar_width)
        eta = duration(batch.eta_s(now)) if batch.status == "in_progress" else batch.status
        done = f"{batch.done:,}/{batch.total:,}"
        shown.add_row(f"{batch.tenant}/{batch.batch_id}", bar, done, f"{batch.failed:,}", eta)
    return shown
