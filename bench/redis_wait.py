"""What confirming a worker's writes on a replica costs (``MET_REDIS_WAIT_REPLICAS=1``).

    python bench/redis_wait.py [--requests 32] [--steps 400] [--rounds 5]

Starts a private ``redis-server`` primary and one replica (127.0.0.1, free ports), then times a worker
transport's ``publish`` of one engine step — one token event for each of ``--requests`` requests: the
``PUBLISH`` es and record appends in one ``MULTI`` — without ``WAIT`` and with ``INCR`` of the mark +
``WAIT 1 100`` after it (``shared/replication.py``),
alternating blocks of ``--steps`` steps for ``--rounds`` rounds (side by side, on a shared machine).
Prints the median and 90th percentile of one step's publish for each, and their ratio.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from metrale.shared.keys import Keys
from metrale.shared.messages import TokenEvent
from metrale.shared.redis_connect import sync_client
from metrale.shared.replication import Replication
from metrale.worker.fleet.broker.redis_transport import RedisTransport


def free_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_servers(directory: str) -> tuple[list[subprocess.Popen[bytes]], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    primary, replica = free_port(), free_port()
    common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory]
    common += ["--repl-diskless-sync-delay", "0"]
    servers = [subprocess.Popen([binary, "--port", str(primary), *common], stdout=subprocess.DEVNULL)]
    replica_of = ["--replicaof", "127.0.0.1", str(primary)]
    servers.append(subprocess.Popen([binary, "--port", str(replica), *common, *replica_of], stdout=subprocess.DEVNULL))
    deadline = time.monotonic() + 20
    while True:
        try:
            with redis.Redis(port=replica, decode_responses=True) as client:
                if client.info("replication").get("master_link_status") == "up":
                    return servers, primary
        except redis.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the replica did not sync")
        time.sleep(0.05)


def time_steps(transport: RedisTransport, worker: str, requests: int, steps: int, first_seq: int) -> list[float]:
    """Seconds of each step's ``publish``."""
    timings = []
    for step in range(steps):
        seq = first_seq + step
        events = [TokenEvent(f"{worker}-r{r}", 0, seq, [100 + step % 50], worker) for r in range(requests)]
        began = time.perf_counter()
        transport.publish(events, [])
        timings.append(time.perf_counter() - began)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        servers, primary = start_servers(directory)
        try:
            url = f"redis://127.0.0.1:{primary}/0"
            keys = Keys("met-bench-wait")
            transports = {
                "no WAIT": RedisTransport(sync_client(url), worker_id="plain", keys=keys),
                "WAIT 1 100": RedisTransport(
                    sync_client(url), worker_id="waits", keys=keys, replication=Replication(1, 100)
                ),
            }
            timings: dict[str, list[float]] = {name: [] for name in transports}
            for round_ in range(args.rounds):
                for name, transport in transports.items():
                    worker = "plain" if name == "no WAIT" else "waits"
                    timings[name] += time_steps(transport, worker, args.requests, args.steps, round_ * args.steps)
            medians = {}
            for name, values in timings.items():
                medians[name] = statistics.median(values)
                p90 = statistics.quantiles(values, n=10)[-1]
                print(f"{name:>10}: median {medians[name] * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms per step")
            ratio = medians["WAIT 1 100"] / medians["no WAIT"]
            print(
                f"WAIT / no WAIT: {ratio:.2f}x ({args.requests} events per step, {len(timings['no WAIT'])} steps each)"
            )
        finally:
            for server in servers:
                server.terminate()
                server.wait(10)


if __name__ == "__main__":
    main()
