"""A Redis Cluster of the tests: three primaries and three replicas of ``redis-server --cluster-enabled
yes`` on 127.0.0.1, created by ``redis-cli --cluster create … --cluster-replicas 1``, with a short
``cluster-node-timeout`` (``NODE_TIMEOUT_MS``) so a replica is promoted within seconds of its primary's
death.

``url`` is the ``redis+cluster://`` URL clients use; ``kill_primary_of(key)`` sends ``kill -9`` to the
primary that holds ``key``'s slot now, and ``wait_for_promotion`` returns once every live node agrees
on a primary for that slot again that answers as one.

Ports: each node takes ``port`` and its cluster bus ``port + 10000``. ``MET_TEST_CLUSTER_PORTS`` names
the first of ``NODES`` consecutive ports to use (for a machine shared with other tests); without it the
group looks for a run of free ones."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.cluster import key_slot

from tests.failover.processes import Process, spawn

PRIMARIES = 3
NODES = 2 * PRIMARIES
NODE_TIMEOUT_MS = 1000
"""How long a primary may be silent before its replica takes over: detection then takes about this, the
election a little more."""
BUS_OFFSET = 10000
SETTLE_S = 30.0
PORTS_VARIABLE = "MET_TEST_CLUSTER_PORTS"


class ClusterGroup:
    """Started by ``start``, stopped by ``stop``; each node logs to ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        self.server_binary = _binary("redis-server")
        self.cli_binary = _binary("redis-cli")
        self.log_dir = log_dir
        self.ports = _ports(NODES)
        self.nodes: dict[int, Process] = {}
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        self.url = f"redis+cluster://{hosts}"

    def start(self) -> None:
        for port in self.ports:
            self._start_node(port)
        addresses = [f"127.0.0.1:{port}" for port in self.ports]
        create = [self.cli_binary, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}\n{self.logs()}")
        self._wait_settled()

    def primary_port_of(self, key: str) -> int:
        """The port of the primary that owns ``key``'s slot, as the first live node tells it."""
        slot = key_slot(key.encode())
        for port in self.live_ports():
            with contextlib.suppress(redis.ConnectionError, redis.ResponseError):
                owner = self._slot_owner(port, slot)
                if owner is not None:
                    return owner
        raise AssertionError(f"no live node names an owner of slot {slot}")

    def primary_ports(self) -> list[int]:
        """The ports of the nodes that are primaries now."""
        return [port for port in self.live_ports() if self._role(port) == "master"]

    def kill_primary_of(self, key: str) -> int:
        """``kill -9`` the primary holding ``key``'s slot; its port."""
        port = self.primary_port_of(key)
        node = self.nodes[port]
        node.signal(signal.SIGKILL)
        node.popen.wait(10)
        return port

    def wait_for_promotion(self, key: str, old_port: int, timeout_s: float = 60.0) -> float:
        """Seconds until every live node names one primary other than ``old_port`` for ``key``'s slot and
        that node answers as a primary."""
        slot = key_slot(key.encode())
        began = time.monotonic()
        while not self._promoted(slot, old_port):
            if time.monotonic() - began > timeout_s:
                pytest.fail(f"no replica took slot {slot} over within {timeout_s} s\n{self.logs()}")
            time.sleep(0.05)
        return time.monotonic() - began

    def live_ports(self) -> list[int]:
        return [port for port, node in self.nodes.items() if node.running]

    def flush(self) -> None:
        """Empty every primary (between tests that share the cluster)."""
        for port in self.primary_ports():
            with redis.Redis(port=port, socket_timeout=5) as client:
                client.flushall()

    def logs(self) -> str:
        return "\n".join(node.log_tail() for node in self.nodes.values())

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()

    def _start_node(self, port: int) -> None:
        data = self.log_dir / f"cluster-{port}"
        data.mkdir()
        args = [self.server_binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", str(data / "nodes.conf")]
        args += ["--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--repl-diskless-sync-delay", "0"]
        self.nodes[port] = spawn(f"cluster-{port}", [*args, "--dir", str(data)], os.environ, self.log_dir)
        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        self.nodes[port].wait_until(lambda: _pings(client), "a cluster node to answer", timeout_s=20)
        client.close()

    def _wait_settled(self) -> None:
        """Until every node reports ``cluster_state:ok`` and every primary has a connected replica: before
        that a primary's death would leave its slots uncovered."""
        deadline = time.monotonic() + SETTLE_S
        while not self._settled():
            if time.monotonic() > deadline:
                pytest.fail(f"the cluster did not settle within {SETTLE_S} s\n{self.logs()}")
            time.sleep(0.1)

    def _settled(self) -> bool:
        try:
            for port in self.ports:
                with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as client:
                    if client.cluster("info")["cluster_state"] != "ok":
                        return False
                    replication = client.info("replication")
                    if replication["role"] == "master" and int(replication["connected_slaves"]) < 1:
                        return False
                    if replication["role"] == "slave" and replication["master_link_status"] != "up":
                        return False
        except (redis.ConnectionError, redis.ResponseError):
            return False
        return True

    def _promoted(self, slot: int, old_port: int) -> bool:
        owners: set[int | None] = set()
        for port in self.live_ports():
            try:
                owners.add(self._slot_owner(port, slot))
            except (redis.ConnectionError, redis.ResponseError):
                return False
        if len(owners) != 1 or None in owners or old_port in owners:
            return False
        (owner,) = owners
        assert owner is not None
        try:
            return self._role(owner) == "master"
        except redis.ConnectionError:
            return False

    @staticmethod
    def _slot_owner(port: int, slot: int) -> int | None:
        with redis.Redis(port=port, socket_timeout=1) as client:
            ranges = client.execute_command("CLUSTER SLOTS")
        for start, end, primary, *_ in ranges:
            if int(start) <= slot <= int(end):
                return int(primary[1])
        return None

    @staticmethod
    def _role(port: int) -> str:
        with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as client:
            return str(client.info("replication")["role"])


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _ports(count: int) -> list[int]:
    """``count`` consecutive ports whose cluster bus ports are free too (or the ones the environment names)."""
    first = os.environ.get(PORTS_VARIABLE)
    if first:
        return list(range(int(first), int(first) + count))
    for _ in range(200):
        base = random.randrange(20000, 30000)
        candidates = list(range(base, base + count))
        if all(_free(port) and _free(port + BUS_OFFSET) for port in candidates):
            return candidates
    pytest.fail(f"found no {count} consecutive free ports (with their bus ports) in 20000..40000")


def _free(port: int) -> bool:
    with contextlib.closing(socket.socket()) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"these tests start their own Redis Cluster with {name}, and none is installed")
    return path
