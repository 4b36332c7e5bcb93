"""The soak benchmark's fleet: a private ``redis-server`` with its append-only file on (killed and
started again on the same port and directory), a ``met gateway``, ``met batch-runner`` and N ``met
worker`` processes, started with ``tests/integration/processes.py``. A worker killed on purpose is
started again at once, as ``met fleet up`` would; any other member that exits is a crash: noted,
and started again too, so the soak goes on and reports it.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import redis

from metrale.shared.keys import Keys
from tests.integration.processes import (
    ManagedProcess,
    free_port,
    http_ready,
    met_environment,
    start_met,
    start_process,
    wait_ready,
)

API_KEY = "sk-soak"
TENANT = "soak"
REDIS_START_S = 30.0


class AofRedis:
    """A ``redis-server`` on a fixed port and directory with ``appendonly yes``, ``appendfsync everysec``:
    after a ``kill -9`` it starts again with what its append-only file holds."""

    def __init__(self, directory: Path, log_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("the soak starts its own redis-server, and none is installed")
        self.binary, self.directory, self.log_dir = binary, directory, log_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: ManagedProcess | None = None
        self.starts = 0
        directory.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        args += ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec"]
        self.starts += 1
        self.process = start_process(f"redis-{self.starts}", args, {}, self.log_dir)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            self.process.wait_until(lambda: _loaded(client), "redis-server to load its AOF", REDIS_START_S)
        finally:
            client.close()

    def kill(self) -> None:
        """``kill -9``: whatever is not yet in the append-only file is gone."""
        if self.process is not None:
            self.process.popen.send_signal(signal.SIGKILL)
            self.process.popen.wait(10)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def _loaded(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.BusyLoadingError):
        return False


@dataclass
class Event:
    """Something that happened to the fleet: a kill, a restart, a crash."""

    at_s: float
    what: str


@dataclass
class SoakFleet:
    """The fleet's processes by name (``worker-1``..., ``gateway``, ``batch-runner``) and Redis."""

    redis: AofRedis
    model_dir: Path
    log_dir: Path
    workers: int
    settings: Mapping[str, str]
    keys: Keys = field(default_factory=lambda: Keys("met"))
    port: int = field(default_factory=free_port)
    members: dict[str, ManagedProcess] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    crashes: int = 0
    started_at: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _generation: dict[str, int] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def environment(self) -> dict[str, str]:
        settings = {**self.settings, "MET_NAMESPACE": self.keys.namespace, "MET_API_KEYS": f"{API_KEY}:{TENANT}"}
        return met_environment(settings, torch_threads=1)

    def start(self) -> None:
        """Redis, the workers, the gateway and the batch runner; return once the gateway is ready and
        every worker beats."""
        self.redis.start()
        for i in range(1, self.workers + 1):
            self._start(f"worker-{i}")
        self._start("gateway")
        self._start("batch-runner")
        gateway = self.members["gateway"]
        wait_ready(gateway, self.base_url, others=list(self.members.values()))
        self.wait_workers_beating()

    def wait_workers_beating(self, timeout_s: float = 180.0) -> None:
        client = redis.Redis.from_url(self.redis.url)
        deadline = time.monotonic() + timeout_s
        try:
            while sum(1 for _ in client.scan_iter(match=self.keys.worker_pattern())) < self.workers:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fewer than {self.workers} workers beat after {timeout_s:.0f} s")
                time.sleep(0.2)
        finally:
            client.close()

    def pids(self) -> dict[str, int]:
        """Every running member's pid by name, Redis's as ``redis``."""
        with self._lock:
            found = {name: m.popen.pid for name, m in self.members.items() if m.popen.poll() is None}
        if self.redis.process is not None and self.redis.process.popen.poll() is None:
            found["redis"] = self.redis.process.popen.pid
        return found

    def kill_worker(self, name: str) -> None:
        """``kill -9`` one worker and start it again at once, as ``met fleet up`` would."""
        with self._lock:
            process = self.members[name]
            process.popen.send_signal(signal.SIGKILL)
            process.popen.wait(10)
            self.note(f"kill -9 {name} (pid {process.popen.pid})")
            self._start(name)

    def restart_redis(self, down_s: float) -> float:
        """``kill -9`` Redis, wait ``down_s``, start it again on its port and AOF; the seconds it was down."""
        started = time.monotonic()
        self.redis.kill()
        self.note("kill -9 redis-server")
        time.sleep(down_s)
        self.redis.start()
        down = time.monotonic() - started
        self.note(f"redis-server started again on its AOF after {down:.1f} s down")
        return down

    def check_members(self) -> None:
        """Start again any member that exited without being killed here: a crash."""
        with self._lock:
            for name, process in list(self.members.items()):
                if process.popen.poll() is not None:
                    self.crashes += 1
                    tail = process.log_tail()[-1500:]
                    self.note(f"CRASH {name} exited with {process.popen.returncode}; log tail:\n{tail}")
                    self._start(name)

    def gateway_ready(self) -> bool:
        return http_ready(self.base_url)

    def note(self, what: str) -> None:
        self.events.append(Event(time.monotonic() - self.started_at, what))

    def stop(self) -> None:
        with self._lock:
            for process in self.members.values():
                process.stop()
        self.redis.stop()

    def _start(self, name: str) -> None:
        generation = self._generation[name] = self._generation.get(name, 0) + 1
        log_name = f"{name}.{generation}"
        url = self.redis.url
        if name == "gateway":
            args = ["gateway", "--redis", url, "--port", str(self.port)]
        elif name == "batch-runner":
            args = ["batch-runner", "--redis", url]
        else:
            args = ["worker", "--redis", url, "--model", str(self.model_dir), "--max-seqs", "16", "--num-blocks", "512"]
        self.members[name] = start_met(log_name, args, self.environment, self.log_dir)
