"""``met fleet up`` hands its worker options to every worker it starts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from metrale.cli import fleet_cmd
from metrale.cli.main import app


class RecordingSupervisor:
    """Records what the fleet starts; the first poll stops it (as Ctrl-C would)."""

    started: ClassVar[dict[str, list[str]]] = {}

    def __init__(self, environment: object, log: object) -> None:
        RecordingSupervisor.started = {}

    def start(self, name: str, argv: Sequence[str]) -> None:
        RecordingSupervisor.started[name] = list(argv)

    def poll(self) -> None:
        raise KeyboardInterrupt

    def stop(self, grace_s: float) -> None:
        pass


@pytest.mark.parametrize(("flag", "passed"), [([], False), (["--compile"], True), (["--no-compile"], False)])
def test_workers_get_the_compile_flag(monkeypatch: pytest.MonkeyPatch, flag: list[str], passed: bool) -> None:
    monkeypatch.setattr("metrale.cli.supervisor.Supervisor", RecordingSupervisor)
    monkeypatch.setattr(fleet_cmd, "_stop_on_signals", lambda: None)
    monkeypatch.setattr(fleet_cmd, "_ignore_stop_signals", lambda: None)
    monkeypatch.setattr(fleet_cmd, "POLL_S", 0.0)
    result = CliRunner().invoke(app, ["fleet", "up", "--workers", "2", "--redis", "redis://127.0.0.1:1/0", *flag])
    assert result.exit_code == 0, result.output
    workers = {name: argv for name, argv in RecordingSupervisor.started.items() if name.startswith("worker-")}
    assert sorted(workers) == ["worker-1", "worker-2"]
    assert all(("--compile" in argv) is passed for argv in workers.values())
    assert "--compile" not in RecordingSupervisor.started["gateway"]
