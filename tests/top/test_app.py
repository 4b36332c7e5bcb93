"""The app driven by Textual's Pilot against a real Redis fed by the fake fleet (the drain order:
``test_drain.py``)."""

from __future__ import annotations

import pytest
import redis
from rich.console import Console
from rich.table import Table
from textual.geometry import Region
from textual.widgets import Static

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import SyncClient
from metrale.top.app import TopApp
from metrale.top.screens import WorkerScreen
from metrale.top.source import RedisSource
from metrale.top.widgets import FleetTable, RequestsTable
from tests.top.conftest import NOW
from tests.top.fake_fleet import FakeFleet, request

pytestmark = pytest.mark.anyio
SIZE = (160, 50)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def top(client: SyncClient, keys: Keys, **kwargs: object) -> TopApp:
    return TopApp(RedisSource(client, keys), clock=lambda: NOW, interval=3600, **kwargs)  # type: ignore[arg-type]


def keys_of(table: FleetTable | RequestsTable) -> list[str]:
    return [str(row.key.value) for row in table.ordered_rows]


async def test_rows_appear_and_update(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    app = top(client, keys)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert keys_of(app.query_one(FleetTable)) == ["cpu-c", "gpu-a", "gpu-b", "gpu-d"]
        requests = app.query_one("#requests", RequestsTable)
        assert keys_of(requests) == ["batch-1", "chat-4", "chat-2", "chat-1", "chat-3"]  # oldest first

        scene.take("gpu-b", [request("chat-5", NOW, age_s=1.0)], tokens=3, taken_ago_s=0.5)
        scene.finish("chat-1")
        scene.worker("gpu-e", device="cuda:2")
        await app.refresh_now()
        assert keys_of(requests)[-1] == "chat-5" and "chat-1" not in keys_of(requests)
        assert "gpu-e" in keys_of(app.query_one(FleetTable))
        assert len(app.history) == 2


async def test_pause_stops_the_refresh(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    app = top(client, keys)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p")
        scene.worker("gpu-e")
        await app._tick()
        assert "gpu-e" not in keys_of(app.query_one(FleetTable)) and app.paused
        await pilot.press("p")
        await app._tick()
        assert "gpu-e" in keys_of(app.query_one(FleetTable))


async def test_s_cycles_the_sort_column(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    app = top(client, keys)
    async with app.run_test(size=SIZE) as pilot:
        requests = app.query_one("#requests", RequestsTable)
        await pilot.press("s")  # tok/s, fastest first
        assert app.sort == "tok/s"
        assert keys_of(requests) == ["chat-1", "chat-4", "chat-2", "chat-3", "batch-1"]  # 10, 6, 4.3, 3, 0.5
        await pilot.press("s")  # tokens
        assert keys_of(requests) == ["chat-4", "chat-2", "chat-1", "batch-1", "chat-3"]
        assert "sorted by tokens" in str(requests.border_title)


async def test_filter_by_model_or_tenant(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    app = top(client, keys)
    async with app.run_test(size=SIZE) as pilot:
        requests = app.query_one("#requests", RequestsTable)
        await pilot.press("slash", *"globex", "enter")
        assert sorted(keys_of(requests)) == ["chat-2", "chat-4"]
        await pilot.press("f", "ctrl+a", "ctrl+k", *"kimi-small", "enter")
        assert keys_of(requests) == ["chat-4"]
        await pilot.press("escape")
        assert len(keys_of(requests)) == 5


async def test_enter_on_a_worker_opens_its_requests_and_counters(
    scene: FakeFleet, client: redis.Redis, keys: Keys
) -> None:
    app = top(client, keys)
    async with app.run_test(size=SIZE) as pilot:
        fleet = app.query_one(FleetTable)
        fleet.focus()
        fleet.move_cursor(row=keys_of(fleet).index("gpu-b"))
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, WorkerScreen) and app.screen.worker_id == "gpu-b"
        assert keys_of(app.screen.query_one(RequestsTable)) == ["chat-4", "chat-3"]
        facts = app.screen.query_one("#worker-facts", Static).content
        assert isinstance(facts, Table)
        text = Console(width=120, record=True)
        text.print(facts)
        shown = text.export_text()
        assert "worker gpu-b" in shown and "cuda:1" in shown and "resumed_requests" in shown
        await pilot.press("escape")
        assert not isinstance(app.screen, WorkerScreen)


async def test_help(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    app = top(client, keys)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape", "q")
    assert app.return_code == 0


def panel_text(panel: Static) -> str:
    """What ``panel`` shows on screen, line by line."""
    lines = panel.render_lines(Region(0, 0, panel.size.width, panel.size.height))
    return "\n".join("".join(segment.text for segment in line) for line in lines)


@pytest.mark.parametrize("width", [100, 120, 160, 220])
async def test_a_batch_is_shown_whole_at_any_common_width(
    fleet: FakeFleet, client: redis.Redis, keys: Keys, width: int
) -> None:
    batch_id = "batch_21a25328c0ffee00d15ea5e1"  # as the gateway names them: batch_ and 24 hex digits
    fleet.batch("default", batch_id, total=5000, completed=1250, failed=3, running_s=100.0)
    app = top(client, keys)
    async with app.run_test(size=(width, 50)) as pilot:
        await pilot.pause()
        shown = panel_text(app.query_one("#batches", Static))
        assert f"default/{batch_id}" in shown, shown
        assert "1,253/5,000" in shown and "4m59s" in shown, shown  # done (failed included), and the eta
