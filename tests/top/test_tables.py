"""The fleet panel's rows: a worker's speculative decoding acceptance, read from its heartbeat counters."""

from __future__ import annotations

import pytest

from metrale.top.queries.fleet import FleetView, RowState, WorkerRow
from metrale.top.tables import FLEET_COLUMNS, fleet_rows
from tests.top.conftest import NOW
from tests.top.fake_fleet import heartbeat


@pytest.mark.parametrize(
    ("counters", "shown"),
    [
        ([("swap_outs", 1)], "-"),
        ([("spec_accepted_tokens", 0), ("spec_draft_tokens", 40)], "0%"),
        ([("spec_accepted_tokens", 62), ("spec_draft_tokens", 100), ("spec_drafts", 30)], "62%"),
    ],
    ids=["never-drafted", "none-accepted", "some-accepted"],
)
def test_the_acceptance_column_is_accepted_over_draft_tokens(counters: list[tuple[str, int]], shown: str) -> None:
    beat = heartbeat("w", NOW, counters=counters)
    view = FleetView(NOW, (WorkerRow("w", RowState.TAKING, beat.sent_at, beat),))
    ((_, cells),) = fleet_rows(view, NOW)
    assert dict(zip(FLEET_COLUMNS, cells, strict=True))["accept"] == shown


def test_a_lost_worker_shows_no_acceptance() -> None:
    view = FleetView(NOW, (WorkerRow("w", RowState.LOST, NOW - 40, None),))
    ((_, cells),) = fleet_rows(view, NOW)
    assert dict(zip(FLEET_COLUMNS, cells, strict=True))["accept"] == "-"
