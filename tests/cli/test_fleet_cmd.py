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


def _started_workers(monkeypatch: pytest.MonkeyPatch, cpus: set[int], *args: str) -> dict[str, list[str]]:
    monkeypatch.setattr("metrale.cli.supervisor.Supervisor", RecordingSupervisor)
    monkeypatch.setattr(fleet_cmd, "_stop_on_signals", lambda: None)
    monkeypatch.setattr(fleet_cmd, "_ignore_stop_signals", lambda: None)
    monkeypatch.setattr(fleet_cmd, "POLL_S", 0.0)
    monkeypatch.setattr(fleet_cmd.os, "sched_getaffinity", lambda pid: cpus)
    result = CliRunner().invoke(app, ["fleet", "up", "--redis", "redis://127.0.0.1:1/0", *args])
    assert result.exit_code == 0, result.output
    return {name: argv for name, argv in RecordingSupervisor.started.items() if name.startswith("worker-")}


def _cpus_of(argv: list[str]) -> str | None:
    return argv[argv.index("--cpus") + 1] if "--cpus" in argv else None


@pytest.mark.parametrize(
    ("workers", "cpus", "shares"),
    [
        (2, {0, 1}, ["0", "1"]),
        (1, {0, 1, 2, 3}, ["0,1,2,3"]),
        (3, {0, 1, 2, 3, 4, 5, 6, 7}, ["0,1,2", "3,4,5", "6,7"]),
        (3, {2, 5}, ["2", "5", "2"]),  # more workers than CPUs: one each, round-robin
    ],
)
def test_each_worker_gets_its_own_share_of_the_cpus(
    monkeypatch: pytest.MonkeyPatch, workers: int, cpus: set[int], shares: list[str]
) -> None:
    started = _started_workers(monkeypatch, cpus, "--workers", str(workers))
    assert [_cpus_of(started[f"worker-{i}"]) for i in range(1, workers + 1)] == shares
    assert "--cpus" not in RecordingSupervisor.started["gateway"]


def test_no_split_cpus_lets_every_worker_use_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    started = _started_workers(monkeypatch, {0, 1}, "--workers", "2", "--no-split-cpus")
    assert [_cpus_of(argv) for argv in started.values()] == [None, None]


NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.mark.parametrize(("flag", "passed"), [([], None), (["--speculative-config", NGRAM], NGRAM)])
def test_workers_get_the_speculative_config(
    monkeypatch: pytest.MonkeyPatch, flag: list[str], passed: str | None
) -> None:
    started = _started_workers(monkeypatch, {0, 1}, "--workers", "2", *flag)
    for argv in started.values():
        given = argv[argv.index("--speculative-config") + 1] if "--speculative-config" in argv else None
        assert given == passed
    assert "--speculative-config" not in RecordingSupervisor.started["gateway"]
