"""Child processes that are kept running: restarted with backoff when they die, stopped together.

``met fleet up`` runs its gateway and workers under one ``Supervisor``. A member that exits with a
non-zero status or a signal is restarted after a delay that doubles with every quick failure (from
``first_delay_s`` up to ``max_delay_s``) and resets once it has run for ``stable_after_s``; a member that
exits 0 finished on purpose (a worker drained by hand) and is left stopped. A member that fails
``give_up_after`` times in a row, each time before it ran stably, is a broken setup, not bad luck: the
supervisor gives up instead of restarting it for ever.

Children run in their own session, so the terminal's Ctrl-C reaches only the supervisor, which stops
them in order; on Linux each child also gets SIGTERM if the supervisor itself dies without stopping
them (``PR_SET_PDEATHSIG``), so no child outlives it even after a ``kill -9``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When and how often a member that died is started again."""

    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_after_s: float = 30.0
    give_up_after: int = 5

    def delay(self, quick_failures: int) -> float:
        """The wait before the restart that follows ``quick_failures`` failures in a row (≥ 1)."""
        return min(self.first_delay_s * 2 ** (quick_failures - 1), self.max_delay_s)


@dataclass(slots=True)
class Member:
    """One supervised process: what to run, the process now, and its failure count."""

    name: str
    argv: Sequence[str]
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_failures: int = 0
    restart_at: float | None = None
    restarts: int = field(default=0)


class GaveUp(RuntimeError):
    """A member failed ``give_up_after`` times in a row."""


class Supervisor:
    """Start members, restart the ones that die, stop them all (SIGTERM, then SIGKILL after a grace)."""

    def __init__(self, environment: Mapping[str, str], log: Log, policy: RestartPolicy | None = None) -> None:
        self._environment = dict(environment)
        self._log = log
        self._policy = policy or RestartPolicy()
        self.members: list[Member] = []

    def start(self, name: str, argv: Sequence[str]) -> Member:
        """Start ``argv`` as the member ``name``."""
        member = Member(name, list(argv))
        self._spawn(member)
        self.members.append(member)
        return member

    def poll(self, now: float | None = None) -> None:
        """Notice members that exited and restart those whose delay has passed; raise ``GaveUp``."""
        now = time.monotonic() if now is None else now
        for member in self.members:
            if member.restart_at is not None:
                if now >= member.restart_at:
                    member.restarts += 1
                    self._spawn(member)
                continue
            code = None if member.process is None else member.process.poll()
            if code is not None:
                self._exited(member, code, now)

    def stop(self, grace_s: float) -> None:
        """SIGTERM every running member (workers drain), wait up to ``grace_s``, then kill what is left."""
        running = [m for m in self.members if m.process is not None and m.process.poll() is None]
        for member in self.members:
            member.restart_at = None
        for member in running:
            assert member.process is not None
            member.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for member in running:
            assert member.process is not None
            try:
                member.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self._log(f"{member.name} (pid {member.process.pid}) did not stop in time; killing it")
                member.process.kill()
                member.process.wait()

    def _exited(self, member: Member, code: int, now: float) -> None:
        assert member.process is not None
        pid, member.process = member.process.pid, None
        status = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
        if code == 0:
            self._log(f"{member.name} (pid {pid}) exited with status 0; not restarting it")
            return
        ran_s = now - member.started_at
        member.quick_failures = 1 if ran_s >= self._policy.stable_after_s else member.quick_failures + 1
        if member.quick_failures >= self._policy.give_up_after:
            raise GaveUp(f"{member.name} failed {member.quick_failures} times in a row (last: {status})")
        delay = self._policy.delay(member.quick_failures)
        member.restart_at = now + delay
        self._log(f"{member.name} (pid {pid}) died with {status} after {ran_s:.1f} s; restarting in {delay:.1f} s")

    def _spawn(self, member: Member) -> None:
        member.process = subprocess.Popen(
            member.argv, env=self._environment, start_new_session=True, preexec_fn=_die_with_parent
        )
        member.started_at = time.monotonic()
        member.restart_at = None
        if member.restarts:
            self._log(f"{member.name} restarted (pid {member.process.pid})")


def _die_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the supervisor dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
