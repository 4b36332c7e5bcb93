"""The main screen at a fixed size and a pinned moment, against the fake fleet (pytest-textual-snapshot).

Update after a deliberate change with ``pytest tests/top/test_snapshots.py --snapshot-update``, then
copy the SVG to ``docs/top.svg`` (the README's screenshot; ``test_the_readme_screenshot_is_current``
says when it is stale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from metrale.shared.keys import Keys
from metrale.top.app import TopApp
from metrale.top.source import RedisSource
from tests.top.conftest import NOW, populate
from tests.top.fake_fleet import FakeFleet

SNAPSHOT_SIZE = (160, 48)
SNAPSHOT = Path(__file__).parent / "__snapshots__" / "test_snapshots" / "test_the_main_screen.svg"
README_SCREENSHOT = Path(__file__).parents[2] / "docs" / "top.svg"


def pinned_app(client: redis.Redis, keys: Keys) -> TopApp:
    return TopApp(RedisSource(client, keys), clock=lambda: NOW, interval=3600, label="redis://redis:6379/0 · met")


def test_the_main_screen(snap_compare: Any, fleet: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    populate(fleet)
    assert snap_compare(pinned_app(client, keys), terminal_size=SNAPSHOT_SIZE)


def test_the_readme_screenshot_is_current() -> None:
    assert README_SCREENSHOT.read_text() == SNAPSHOT.read_text(), "copy the snapshot SVG to docs/top.svg"
