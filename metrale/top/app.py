"""``met top``'s Textual app: the panels on one screen, refreshed every ``interval`` seconds.

The app reads through a source (``RedisSource``: Redis and a key space) in a thread, and asks the
injected ``clock`` what time it is, so a test pins both.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import ClassVar, Protocol

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Container
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Input, Static

from metrale.top.queries.snapshot import Snapshot
from metrale.top.screens import ConfirmDrain, HelpScreen, WorkerScreen
from metrale.top.tables import REQUEST_SORTS, clock_time
from metrale.top.widgets import BatchesPanel, CountersPanel, FleetPanel, FleetTable, QueuesPanel, RequestsTable

HISTORY = 300
"""Refreshes the fleet tok/s sparkline spans (5 minutes at the default interval)."""
SORTS = list(REQUEST_SORTS)


class Source(Protocol):
    def read(self, now: float, previous: Snapshot | None) -> Snapshot: ...

    def drain(self, worker_id: str) -> int: ...


WIDE_SCREEN = 190
"""Columns from which the batches panel fits beside the queues and counters with a whole batch row."""


class TopApp(App[None]):
    """The fleet, live. ``label`` names what is watched (Redis URL and namespace) in the title bar."""

    TITLE = "met top"
    CSS_PATH = "top.tcss"
    # Textual types it as an instance attribute, so mypy refuses a ClassVar annotation here.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE_SCREEN, "-wide")]  # noqa: RUF012
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("p", "pause", "pause"),
        Binding("s", "sort", "sort"),
        Binding("slash,f", "filter", "filter"),
        Binding("d", "drain_selected", "drain"),
        Binding("question_mark", "help", "help"),
        Binding("escape", "clear_filter", "clear filter", show=False),
    ]

    def __init__(
        self, source: Source, *, clock: Callable[[], float] = time.time, interval: float = 1.0, label: str = ""
    ) -> None:
        super().__init__()
        self.source, self.clock, self.interval, self.label = source, clock, interval, label
        self.snapshot: Snapshot | None = None
        self.history: deque[float] = deque(maxlen=HISTORY)
        self.paused = False
        self.sort = SORTS[0]
        self.filter_text = ""
        self._timer: Timer | None = None
        self._reading = asyncio.Lock()

    def compose(self) -> ComposeResult:
        yield Static(id="title")
        yield FleetPanel(id="fleet")
        with Container(id="middle"):
            yield QueuesPanel(id="queues")
            yield CountersPanel(id="counters")
            yield BatchesPanel(id="batches")
        yield RequestsTable(id="requests", cursor_type="row", zebra_stripes=True)
        yield Input(placeholder="filter requests by model or tenant", id="filter")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#filter", Input).display = False
        self.query_one("#fleet").border_title = "Fleet"
        self._show_title()
        await self.refresh_now()
        self._timer = self.set_interval(self.interval, self._tick)

    async def _tick(self) -> None:
        if not self.paused and not self._reading.locked():
            await self.refresh_now()

    async def refresh_now(self) -> None:
        """Read a snapshot (in a thread: the client blocks) and show it."""
        async with self._reading:
            snapshot = await asyncio.to_thread(self.source.read, self.clock(), self.snapshot)
        self.snapshot = snapshot
        self.history.append(snapshot.fleet.tokens_per_s)
        self._show()

    def _show(self) -> None:
        snapshot = self.snapshot
        self._show_title()
        if snapshot is None:
            return
        self.query_one(FleetPanel).show(snapshot.fleet, snapshot.at, list(self.history))
        self.query_one(QueuesPanel).show(snapshot.queues)
        self.query_one(CountersPanel).show(snapshot.counters)
        self.query_one(BatchesPanel).show(snapshot.batches, snapshot.at)
        requests = self.query_one("#requests", RequestsTable)
        requests.show(snapshot.requests, sort=self.sort, text=self.filter_text)
        shown, total = requests.row_count, snapshot.requests.total
        where = f" · filter '{self.filter_text}'" if self.filter_text else ""
        requests.border_title = f"Requests in flight: {shown} of {total} · sorted by {self.sort}{where}"
        if isinstance(self.screen, WorkerScreen):
            self.screen.show(snapshot, sort=self.sort)

    def _show_title(self) -> None:
        moment = clock_time(self.snapshot.at) if self.snapshot is not None else "reading…"
        state = " · [reverse] PAUSED [/reverse]" if self.paused else ""
        label = f" · {self.label}" if self.label else ""
        self.query_one("#title", Static).update(f"[b]met top[/b]{label} · {moment}{state}")

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._show_title()

    def action_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        self._show()

    def action_filter(self) -> None:
        field = self.query_one("#filter", Input)
        field.display = True
        field.value = self.filter_text
        field.focus()

    def action_clear_filter(self) -> None:
        field = self.query_one("#filter", Input)
        field.display = False
        self.filter_text = ""
        self.query_one(FleetTable).focus()
        self._show()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.filter_text = event.value.strip()
        event.input.display = False
        self.query_one(FleetTable).focus()
        self._show()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if isinstance(event.data_table, FleetTable) and event.row_key.value is not None:
            self.open_worker(event.row_key.value)

    def open_worker(self, worker_id: str) -> None:
        screen = WorkerScreen(worker_id)
        self.push_screen(screen)
        if self.snapshot is not None:
            self.call_after_refresh(screen.show, self.snapshot, sort=self.sort)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_drain_selected(self) -> None:
        screen = self.screen
        worker_id = screen.worker_id if isinstance(screen, WorkerScreen) else self.query_one(FleetTable).selected_worker
        if worker_id is None:
            self.notify("no worker selected", severity="warning")
            return

        async def answered(drain: bool | None) -> None:
            if drain:
                await self.drain(worker_id)

        self.push_screen(ConfirmDrain(worker_id), answered)

    async def drain(self, worker_id: str) -> None:
        """Send ``worker_id`` the drain order and say whether it was heard."""
        heard = await asyncio.to_thread(self.source.drain, worker_id)
        if heard:
            self.notify(f"drain sent to {worker_id}: it hands back what it runs and exits")
        else:
            self.notify(f"{worker_id} is not listening (lost, or gone)", severity="error")
