"""Real ``met`` processes for end-to-end tests and benchmarks: started on free ports, waited for, and
always torn down (SIGTERM, then SIGKILL for the process and any children it left behind).

Each process writes its output to a log file, never to a pipe: a gateway logs every request, and a
full pipe would stall it mid-test. A failure quotes the log's tail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

MET = Path(sys.executable).with_name("met")
"""The ``met`` entry point of the running virtualenv."""
STARTUP_TIMEOUT_S = 90.0
"""Loading torch and the model takes seconds alone; on two busy cores, much longer."""
STOP_TIMEOUT_S = 20.0
LOG_TAIL_CHARS = 4000


class ProcessFailed(RuntimeError):
    """A process exited early or never became ready; the message ends with its log's tail."""


@dataclass
class ManagedProcess:
    """One running process and the file its output goes to."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self) -> str:
        """The last part of what the process wrote."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-LOG_TAIL_CHARS:]

    def fail(self, why: str) -> ProcessFailed:
        """An error naming this process and ``why``, with its log."""
        return ProcessFailed(f"{self.name}: {why}\n--- log of {self.name} ---\n{self.log_tail()}")

    def wait_until(self, condition: Callable[[], bool], what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Poll ``condition`` until it holds; raise if the process exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.popen.poll() is not None:
                raise self.fail(f"exited with status {self.popen.returncode} while waiting for {what}")
            if time.monotonic() > deadline:
                raise self.fail(f"gave up waiting {timeout_s:.0f} s for {what}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait, then SIGKILL the process and its children; return its exit status."""
        if self.popen.poll() is None:
            children = _children(self.popen.pid)  # read now: they are re-parented once it dies
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                for pid in (*children, *_children(self.popen.pid)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_process(name: str, command: Sequence[str], env: Mapping[str, str], log_dir: Path) -> ManagedProcess:
    """Start ``command`` with exactly ``env`` as its environment, its output going to ``log_dir/name.log``."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(list(command), env=dict(env), stdout=log, stderr=subprocess.STDOUT)
    return ManagedProcess(name, popen, log_path)


def start_met(name: str, args: Sequence[str], env: Mapping[str, str], log_dir: Path) -> ManagedProcess:
    """Start ``met ARGS`` (see ``start_process``)."""
    return start_process(name, [str(MET), *args], env, log_dir)


def met_environment(settings: Mapping[str, str], *, torch_threads: int) -> dict[str, str]:
    """This process's environment without any ``MET_*`` variable, plus ``settings`` (``MET_*`` names),
    with torch limited to ``torch_threads`` threads."""
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("MET_")}
    return inherited | dict(settings) | {"OMP_NUM_THREADS": str(torch_threads)}


def http_ready(base_url: str) -> bool:
    """Whether ``GET /ready`` answers 200 (Redis reachable and a worker live)."""
    try:
        return httpx.get(f"{base_url}/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(gateway: ManagedProcess, base_url: str, others: Sequence[ManagedProcess] = ()) -> None:
    """Wait for the gateway at ``base_url`` to be ready, failing early if any of ``others`` exits."""

    def ready() -> bool:
        for other in others:
            if other.popen.poll() is not None:
                raise other.fail(f"exited with status {other.popen.returncode} before the gateway was ready")
        return http_ready(base_url)

    gateway.wait_until(ready, f"{base_url}/ready")


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux ``/proc``), e.g. the private Redis of ``met serve``."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(child) for child in (task / "children").read_text().split()]
    return children
