"""The screens over the main one: help, a worker's detail, and the drain confirmation."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from metrale.top.queries.snapshot import Snapshot
from metrale.top.tables import duration
from metrale.top.widgets import RequestsTable

HELP = """\
[b]met top[/b] — the fleet, live from Redis

  [b]p[/b]        pause / resume the refresh
  [b]s[/b]        sort the requests by the next column
  [b]/[/b] or [b]f[/b]   filter the requests by model or tenant (Enter applies, Esc clears)
  [b]Enter[/b]    on a worker: its detail (its requests, its counters)
  [b]d[/b]        drain the selected worker (it hands back what it runs and exits)
  [b]?[/b]        this help
  [b]q[/b]        quit

Fleet: one row per worker (lost: stopped beating without withdrawing); accept = draft tokens accepted
of those verified (speculative decoding; - before any). Queues: waiting = not yet taken, pending =
taken and not acknowledged. Tokens of a request = events in its record."""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help", classes="modal")


class ConfirmDrain(ModalScreen[bool]):
    """Asks before draining a worker; dismissed with True to drain."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "drain"),
        Binding("n,escape", "answer(False)", "keep"),
    ]

    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id

    def compose(self) -> ComposeResult:
        text = (
            f"Drain worker [b]{self.worker_id}[/b]?\n\nIt takes no new requests, hands back (or finishes) "
            "what it runs, and exits.\n\n[b]y[/b] drain   [b]n[/b] keep it"
        )
        yield Static(text, id="confirm", classes="modal")

    def action_answer(self, drain: bool) -> None:
        self.dismiss(drain)


class WorkerScreen(ModalScreen[None]):
    """One worker: its heartbeat, its own counters, the requests it runs."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "dismiss", "close"),
        Binding("d", "app.drain_selected", "drain"),
    ]

    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id

    def compose(self) -> ComposeResult:
        with Vertical(id="worker-detail", classes="modal"):
            yield Static(id="worker-facts")
            yield RequestsTable(id="worker-requests", cursor_type="row")

    def show(self, snapshot: Snapshot, *, sort: str) -> None:
        row = snapshot.fleet.worker(self.worker_id)
        facts = Table(title=f"worker {self.worker_id}", title_justify="left", show_header=False, expand=True)
        facts.add_column("what")
        facts.add_column("value")
        facts.add_column("counter")
        facts.add_column("count", justify="right")
        beat = row.heartbeat if row is not None else None
        state = row.state.value if row is not None else "gone"
        age = duration(row.heartbeat_age_s(snapshot.at)) if row is not None else "-"
        values = [("state", state), ("last heartbeat", age)]
        if beat is not None:
            values += [
                ("model", beat.model),
                ("device", beat.device or "-"),
                ("up", duration(snapshot.at - beat.started_at)),
                ("tok/s", f"{beat.tokens_per_s:,.1f}"),
                ("batch", str(beat.batch_size)),
            ]
        counters = list(beat.counters) if beat is not None else []
        for position in range(max(len(values), len(counters))):
            what, value = values[position] if position < len(values) else ("", "")
            name, count = counters[position] if position < len(counters) else ("", "")
            facts.add_row(what, value, str(name), f"{count:,}" if count != "" else "")
        self.query_one("#worker-facts", Static).update(facts)
        self.query_one(RequestsTable).show(snapshot.requests, sort=sort, text="", worker=self.worker_id)
