"""A Redis that can fail over, of one test alone: a primary, a replica and three ``redis-sentinel``
processes, all on 127.0.0.1 free ports, with short failure detection (``DOWN_AFTER_MS``).

``url`` is the ``redis+sentinel://`` URL clients use; ``kill_primary`` sends ``kill -9`` to whichever
server is the primary now, and ``wait_for_promotion`` returns once the sentinels name another one."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import redis

from tests.failover.processes import Process, free_port, spawn

SERVICE = "metfleet"
QUORUM = 2
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
SETTLE_S = 30.0
"""How long the sentinels get to find the replica and each other before a test may start."""


class SentinelGroup:
    """Started by ``start``, stopped by ``stop``; each process logs to ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        self.server_binary = _binary("redis-server")
        self.sentinel_binary = _binary("redis-sentinel")
        self.log_dir = log_dir
        self.server_ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.servers: dict[int, Process] = {}
        self.sentinels: list[Process] = []
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        self.url = f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> None:
        primary, replica = self.server_ports
        self._start_server(primary)
        self._start_server(replica, "--replicaof", "127.0.0.1", str(primary))
        for port in self.sentinel_ports:
            self._start_sentinel(port, primary)
        self._wait_settled(primary)

    def primary_port(self) -> int:
        """The primary's port as the sentinels name it now (the first that answers)."""
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as sentinel:
                    address = sentinel.sentinel_get_master_addr_by_name(SERVICE)
            except redis.ConnectionError:
                continue
            if address:
                return int(address[1])
        raise AssertionError("no sentinel names a primary")

    def kill_primary(self) -> int:
        """``kill -9`` the primary; its port."""
        port = self.primary_port()
        server = self.servers[port]
        server.signal(signal.SIGKILL)
        server.popen.wait(10)
        return port

    def wait_for_promotion(self, old_port: int, timeout_s: float = 60.0) -> float:
        """Seconds until every sentinel names a primary other than ``old_port`` that answers as one."""
        began = time.monotonic()
        while True:
            try:
                if self._promoted(old_port):
                    return time.monotonic() - began
            except redis.ConnectionError:
                pass
            if time.monotonic() - began > timeout_s:
                pytest.fail(f"no replica was promoted within {timeout_s} s\n{self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        return "\n".join(process.log_tail() for process in [*self.servers.values(), *self.sentinels])

    def stop(self) -> None:
        for process in [*self.sentinels, *self.servers.values()]:
            process.stop()

    def _promoted(self, old_port: int) -> bool:
        ports = set()
        for port in self.sentinel_ports:
            with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as sentinel:
                address = sentinel.sentinel_get_master_addr_by_name(SERVICE)
            ports.add(int(address[1]) if address else None)
        if len(ports) != 1 or old_port in ports or None in ports:
            return False
        with redis.Redis(port=ports.pop(), socket_timeout=1, decode_responses=True) as primary:
            return bool(primary.info("replication")["role"] == "master")

    def _start_server(self, port: int, *extra: str) -> None:
        data = self.log_dir / f"redis-{port}"
        data.mkdir()
        args = [self.server_binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--repl-diskless-sync-delay", "0"]  # a replica's first sync at once, not after 5 s
        self.servers[port] = spawn(f"redis-{port}", [*args, "--dir", str(data), *extra], os.environ, self.log_dir)
        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        self.servers[port].wait_until(lambda: _pings(client), "redis-server to answer", timeout_s=20)
        client.close()

    def _start_sentinel(self, port: int, primary: int) -> None:
        config = self.log_dir / f"sentinel-{port}.conf"  # a sentinel rewrites its config file: one each
        config.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.log_dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} {QUORUM}\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self.sentinels.append(spawn(f"sentinel-{port}", [self.sentinel_binary, str(config)], os.environ, self.log_dir))

    def _wait_settled(self, primary: int) -> None:
        """Until every sentinel monitors the primary, knows the replica, and sees the two other sentinels:
        before that a failover cannot reach its quorum."""
        deadline = time.monotonic() + SETTLE_S
        while not self._settled(primary):
            if time.monotonic() > deadline:
                pytest.fail(f"the sentinels did not settle within {SETTLE_S} s\n{self.logs()}")
            time.sleep(0.1)

    def _settled(self, primary: int) -> bool:
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as sentinel:
                    state = sentinel.sentinel_master(SERVICE)
                    replicas = sentinel.sentinel_slaves(SERVICE)
            except (redis.ConnectionError, redis.ResponseError):
                return False
            if int(state["port"]) != primary or int(state["num-other-sentinels"]) < len(self.sentinel_ports) - 1:
                return False
            if not any(replica["master-link-status"] == "ok" for replica in replicas):
                return False
        return True


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"these tests start their own {name}, and none is installed (apt-get install redis-sentinel)")
    return path


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
