"""The panels of ``met top``: small widgets, each shown one query's result (``tables.py`` words it)."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Sparkline, Static

from metrale.top.queries.batches import BatchesView
from metrale.top.queries.counters import CountersView
from metrale.top.queries.fleet import FleetView
from metrale.top.queries.queues import QueuesView
from metrale.top.queries.requests import RequestsView
from metrale.top.tables import (
    FLEET_COLUMNS,
    REQUEST_COLUMNS,
    Row,
    batches_table,
    counters_table,
    fleet_rows,
    queues_table,
    request_rows,
)


def fill(table: DataTable[str], columns: Sequence[str], rows: Sequence[Row]) -> None:
    """Replace a table's rows, keeping the cursor on the row it was on (by key)."""
    if not table.columns:
        table.add_columns(*columns)
    current = None
    if table.row_count and 0 <= table.cursor_row < table.row_count:
        current = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    table.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)
    keys = [key for key, _ in rows]
    if current in keys:
        table.move_cursor(row=keys.index(current), animate=False)


class FleetTable(DataTable[str]):
    """One row per worker; Enter opens its detail, ``d`` drains it."""

    def show(self, view: FleetView, now: float) -> None:
        fill(self, FLEET_COLUMNS, fleet_rows(view, now))

    @property
    def selected_worker(self) -> str | None:
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value


class FleetPanel(Vertical):
    """The workers, and a sparkline of the fleet's tokens per second over the last minutes."""

    def compose(self) -> ComposeResult:
        yield FleetTable(id="fleet-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="fleet-rate")
        yield Sparkline([], id="fleet-spark")

    def show(self, view: FleetView, now: float, history: Sequence[float]) -> None:
        self.query_one(FleetTable).show(view, now)
        live = sum(1 for row in view.workers if row.heartbeat is not None)
        minutes = len(history) / 60
        self.query_one("#fleet-rate", Static).update(
            f"fleet {view.tokens_per_s:,.1f} tok/s · {live} live of {len(view.workers)} · "
            f"last {minutes:.1f} min, peak {max(history, default=0.0):,.1f}:"
        )
        self.query_one(Sparkline).data = list(history) or [0.0]


class QueuesPanel(Static):
    def show(self, view: QueuesView) -> None:
        self.update(queues_table(view))


class CountersPanel(Static):
    def show(self, view: CountersView) -> None:
        self.update(counters_table(view))


class BatchesPanel(Static):
    def show(self, view: BatchesView, now: float) -> None:
        self.update(batches_table(view, now))


class RequestsTable(DataTable[str]):
    """The requests in flight, sorted and filtered as the app says."""

    def show(self, view: RequestsView, *, sort: str, text: str, worker: str | None = None) -> None:
        fill(self, REQUEST_COLUMNS, request_rows(view, sort=sort, text=text, worker=worker))
