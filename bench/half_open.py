"""Half-open sockets against a real gateway: does ``/health`` still answer? (issue #29)

    python -m bench.half_open [--sockets 20000] [--processes 2] [--hold-s 15] [--port 8250] [--url URL]

Without ``--url`` it starts ``met gateway`` on ``--port`` (loopback) over a private Redis
(``redis-server`` if installed, else fakeredis), with the gateway's default HTTP limits unless
``MET_HTTP_*`` say otherwise. ``--processes`` client processes (each raises its own open-file limit
to the hard one: 20,000 here, so 2 × 10,000) open ``--sockets`` connections in all, each sending a
request line and one header but never the blank line that ends the headers, and hold them for
``--hold-s`` seconds. Meanwhile ``GET /health`` is sent every ``--every-s`` over a fresh connection;
the result is its latency p50 / p99 / max and how many of the half-open sockets the server closed
(the cap evicts the oldest, the header timeout the rest). Goal: p99 < 50 ms. Everything stops by
itself; nothing leaves the loopback interface.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event

HALF_SENT = b"GET /health HTTP/1.1\r\nHost: gateway\r\n"
GOAL_P99_MS = 50.0


def hold_sockets(port: int, count: int, hold_s: float, opened: Event, results: multiprocessing.Queue[dict]) -> None:
    """One client process: open ``count`` half-open sockets, hold them ``hold_s`` after all are open."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sockets, refused = [], 0
    for _ in range(count):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(HALF_SENT)
            sockets.append(sock)
        except OSError:
            refused += 1
    opened.set()
    time.sleep(hold_s)
    closed = sum(_closed(sock) for sock in sockets)
    for sock in sockets:
        sock.close()
    results.put({"opened": len(sockets), "connect_failed": refused, "closed_by_server": closed})


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1024) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def health_ms(port: int) -> float | None:
    """``GET /health`` over a fresh connection: milliseconds, or None when it failed."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        ok = response.status == 200 and response.read() == b'{"status":"ok"}'
    except OSError:
        ok = False
    finally:
        connection.close()
    return (time.perf_counter() - start) * 1000 if ok else None


@contextlib.contextmanager
def gateway(port: int) -> Iterator[None]:
    """``met gateway`` on ``port`` over a private Redis, until the block ends."""
    from metrale.cli.embedded_redis import start_embedded_redis

    redis = start_embedded_redis()
    met = os.path.join(os.path.dirname(sys.executable), "met")
    process = subprocess.Popen([met, "gateway", "--redis", redis.url, "--port", str(port)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while health_ms(port) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                log = process.stderr.read().decode() if process.stderr else ""
                raise SystemExit(f"met gateway did not start: {log}")
            time.sleep(0.2)
        yield
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            _, stderr = process.communicate(timeout=20)
            print("gateway log (last lines):", *stderr.decode().splitlines()[-6:], sep="\n  ", file=sys.stderr)
        if process.poll() is None:
            process.kill()
        redis.close()


def measure(port: int, sockets: int, processes: int, hold_s: float, every_s: float) -> dict[str, object]:
    """Open and hold the sockets from ``processes`` clients; ``/health`` latencies while they are held."""
    results: multiprocessing.Queue[dict] = multiprocessing.Queue()
    events = [multiprocessing.Event() for _ in range(processes)]
    share = -(-sockets // processes)
    clients = [
        multiprocessing.Process(target=hold_sockets, args=(port, share, hold_s, event, results)) for event in events
    ]
    start = time.monotonic()
    for client in clients:
        client.start()
    for event in events:
        event.wait(timeout=300)
    opened_s = time.monotonic() - start
    latencies, failures = [], 0
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        latency = health_ms(port)
        failures += latency is None
        latencies += [latency] if latency is not None else []
        time.sleep(every_s)
    counts = [results.get(timeout=60) for _ in clients]
    for client in clients:
        client.join(timeout=30)
    latencies.sort()
    summary: dict[str, object] = {key: sum(c[key] for c in counts) for key in counts[0]}
    summary.update(
        open_seconds=round(opened_s, 1),
        health_requests=len(latencies) + failures,
        health_failed=failures,
        health_p50_ms=_pct(latencies, 0.50),
        health_p99_ms=_pct(latencies, 0.99),
        health_max_ms=round(latencies[-1], 2) if latencies else None,
    )
    p99 = summary["health_p99_ms"]
    summary["goal_met"] = failures == 0 and isinstance(p99, float) and p99 < GOAL_P99_MS
    return summary


def _pct(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 2) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sockets", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--hold-s", type=float, default=15.0)
    parser.add_argument("--every-s", type=float, default=0.02)
    parser.add_argument("--port", type=int, default=8250)
    parser.add_argument("--url", help="an already running gateway on loopback, e.g. http://127.0.0.1:8000")
    args = parser.parse_args()
    if args.url is not None:
        port = int(args.url.rsplit(":", 1)[1].strip("/"))
        summary = measure(port, args.sockets, args.processes, args.hold_s, args.every_s)
    else:
        with gateway(args.port):
            summary = measure(args.port, args.sockets, args.processes, args.hold_s, args.every_s)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
