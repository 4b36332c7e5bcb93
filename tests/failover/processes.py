"""Real processes for the failover tests: a private ``redis-server`` that can be stopped and started
again on its port, and ``met`` gateways and workers. Output goes to log files (a full pipe would
stall a process); a failure quotes the log's tail. Everything started is torn down."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

MET = Path(sys.executable).with_name("met")
STARTUP_S = 120.0
"""Importing torch and loading the model takes seconds alone; several at once on two busy cores longer."""
LOG_TAIL_CHARS = 3000


@dataclass
class Process:
    """One running child and the file its output goes to."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.name} ---\n{text[-LOG_TAIL_CHARS:]}"

    def wait_until(self, condition: Callable[[], bool], what: str, timeout_s: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if not self.running:
                pytest.fail(f"{self.name} exited ({self.popen.returncode}) while waiting for {what}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name}: gave up waiting for {what}\n{self.log_tail()}")
            time.sleep(0.05)

    def signal(self, signum: signal.Signals) -> None:
        if self.running:
            self.popen.send_signal(signum)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; its exit status."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int(child) for task in tasks for child in (task / "children").read_text().split()]


def spawn(name: str, command: Sequence[str], env: Mapping[str, str], log_dir: Path) -> Process:
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(list(command), env=dict(env), stdout=log, stderr=subprocess.STDOUT)
    return Process(name, popen, log_path)


class RedisServer:
    """A ``redis-server`` of this test alone, without persistence: a restart starts it empty."""

    def __init__(self, log_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("these tests start their own redis-server, and none is installed")
        self.binary, self.log_dir, self.port = binary, log_dir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: Process | None = None

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = spawn("redis", [*args, "--dir", str(self.log_dir)], os.environ, self.log_dir)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        self.process.wait_until(lambda: _pings(client), "redis-server to answer", timeout_s=20)
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def met_environment(settings: Mapping[str, str]) -> dict[str, str]:
    """This environment without any ``MET_*`` variable, plus ``settings``, torch on one thread."""
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("MET_")}
    return inherited | dict(settings) | {"OMP_NUM_THREADS": "1"}


def ready(base_url: str) -> bool:
    """Whether the gateway answers ``/ready`` (Redis reachable, a worker live)."""
    try:
        return httpx.get(f"{base_url}/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
