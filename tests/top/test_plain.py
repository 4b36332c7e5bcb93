"""``met top --once`` against the fake fleet: every panel printed once as plain text."""

from __future__ import annotations

import pytest
import redis
from rich.console import Console
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.shared.keys import Keys
from metrale.top.plain import render
from metrale.top.queries.snapshot import read_snapshot
from tests.top.conftest import NOW
from tests.top.fake_fleet import FakeFleet


def test_render_prints_every_panel(scene: FakeFleet, client: redis.Redis, keys: Keys) -> None:
    console = Console(width=160, record=True)
    render(read_snapshot(client, keys, NOW), console, label="test")
    text = console.export_text()
    assert "met top · test · 2026-09-21 14:13:20 UTC" in text
    for panel in ("Fleet", "Queues", "Checkpoints and failover", "Batches", "Requests in flight"):
        assert panel in text
    assert "gpu-a" in text and "812.4" in text and "lost" in text and "draining" in text
    assert "fleet 1,483.4 tok/s · 3 live of 4" in text
    assert "5 shown of 5 in flight" in text and "acme/batch_abc" in text and "75% (30)" in text


def test_met_top_once_from_the_command_line(scene: FakeFleet, keys: Keys, real_redis_url: str) -> None:
    result = CliRunner().invoke(
        app, ["top", "--once", "--redis", real_redis_url, "--namespace", keys.namespace, "--filter", "globex"]
    )
    assert result.exit_code == 0, result.output
    assert f"{real_redis_url} · {keys.namespace}" in result.output
    assert "gpu-b" in result.output and "chat-4" in result.output and "chat-1" not in result.output
    assert "2 shown of 5 in flight (filter 'globex')" in result.output


def test_met_top_without_redis_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MET_REDIS_URL", raising=False)
    result = CliRunner().invoke(app, ["top", "--once"])
    assert result.exit_code == 1 and "no Redis to watch" in result.output
