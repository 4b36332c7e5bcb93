"""The supervisor behind ``met fleet up``, on real child processes: restarts with backoff, leaves a
clean exit alone, gives up on a member that keeps failing, and stops everything it started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metrale.cli.supervisor import GaveUp, RestartPolicy, Supervisor

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
FAIL = [sys.executable, "-c", "raise SystemExit(3)"]
SUCCEED = [sys.executable, "-c", "pass"]
FAST = RestartPolicy(first_delay_s=0.05, max_delay_s=0.2, stable_after_s=5.0, give_up_after=3)


def poll_until(supervisor: Supervisor, condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        supervisor.poll()
        time.sleep(0.02)


def test_the_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=4.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def test_a_killed_member_is_restarted_and_logged() -> None:
    lines: list[str] = []
    supervisor = Supervisor(os.environ, lines.append, FAST)
    member = supervisor.start("worker-1", SLEEP)
    try:
        assert member.process is not None
        first_pid = member.process.pid
        member.process.kill()
        poll_until(supervisor, lambda: member.process is not None and member.process.pid != first_pid)
        assert member.restarts == 1
        assert any("worker-1" in line and "SIGKILL" in line for line in lines), lines
        assert any("restarted" in line for line in lines), lines
    finally:
        supervisor.stop(grace_s=5)
    assert member.process is not None and member.process.poll() is not None


def test_a_clean_exit_is_not_restarted() -> None:
    lines: list[str] = []
    supervisor = Supervisor(os.environ, lines.append, FAST)
    member = supervisor.start("worker-1", SUCCEED)
    poll_until(supervisor, lambda: member.process is None)
    time.sleep(0.2)
    supervisor.poll()
    assert member.process is None and member.restarts == 0
    assert any("status 0" in line for line in lines), lines


def test_a_member_that_keeps_failing_makes_the_supervisor_give_up() -> None:
    supervisor = Supervisor(os.environ, lambda _: None, FAST)
    member = supervisor.start("worker-1", FAIL)
    with pytest.raises(GaveUp, match="worker-1 failed 3 times in a row"):
        poll_until(supervisor, lambda: False)
    assert member.restarts == FAST.give_up_after - 1  # started once, restarted after each failure but the last


def test_stop_kills_a_member_that_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = [
        sys.executable,
        "-c",
        "import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(tmp_path / 'ready')!r}).touch(); time.sleep(60)",
    ]
    lines: list[str] = []
    supervisor = Supervisor(os.environ, lines.append, FAST)
    member = supervisor.start("gateway", stubborn)
    poll_until(supervisor, lambda: (tmp_path / "ready").exists())
    supervisor.stop(grace_s=0.5)
    assert member.process is not None and member.process.poll() is not None
    assert any("killing it" in line for line in lines), lines


def test_children_get_sigterm_when_the_supervisor_dies(tmp_path: Path) -> None:
    """``kill -9`` of the supervising process itself: its members still stop (PR_SET_PDEATHSIG)."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import os, sys, time\n"
        "from metrale.cli.supervisor import Supervisor\n"
        "s = Supervisor(os.environ, print)\n"
        "m = s.start('w', [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(m.process.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and _state(child) != "Z":
        assert time.monotonic() < deadline, "the member outlived its supervisor"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "gone"
