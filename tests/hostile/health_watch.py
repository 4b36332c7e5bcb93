"""``/health`` watched from a process of its own while a hostile case runs.

The probe runs in a separate process so that what the test itself does (building a megabyte of JSON,
holding thousands of sockets) never delays the measurement: each probe opens a fresh connection, as a
load balancer's health check does, sends ``GET /health`` and times it to the last byte of the answer.
A probe that fails or gets no answer within ``PROBE_TIMEOUT_S`` counts as that long.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from urllib.parse import urlsplit

PROBE_INTERVAL_S = 0.01
PROBE_TIMEOUT_S = 5.0
P99_BOUND_S = 0.050
MAX_BOUND_S = 0.250


@dataclass(frozen=True)
class HealthReport:
    """Latencies (seconds) of the probes sent while a case ran; failed probes are ``PROBE_TIMEOUT_S``."""

    latencies: tuple[float, ...]
    failures: int

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]

    @property
    def worst(self) -> float:
        return max(self.latencies)

    def __str__(self) -> str:
        return (
            f"{len(self.latencies)} probes, {self.failures} failed: p50 {self.quantile(0.5) * 1e3:.1f} ms, "
            f"p99 {self.quantile(0.99) * 1e3:.1f} ms, max {self.worst * 1e3:.1f} ms"
        )

    def assert_responsive(self, p99_s: float = P99_BOUND_S, max_s: float = MAX_BOUND_S) -> None:
        """The issue's bound by default: ``/health`` p99 < 50 ms and max < 250 ms throughout the case."""
        assert self.latencies, "no /health probe ran"
        assert self.failures == 0, f"/health failed: {self}"
        assert self.quantile(0.99) < p99_s, f"/health p99 over {p99_s * 1e3:.0f} ms: {self}"
        assert self.worst < max_s, f"/health max over {max_s * 1e3:.0f} ms: {self}"


def _probe_once(host: str, port: int) -> float | None:
    """Seconds one ``GET /health`` took on a fresh connection, or None when it failed."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection(host, port, timeout=PROBE_TIMEOUT_S)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        ok = response.status == 200
    except OSError:
        ok = False
    finally:
        connection.close()
    return time.perf_counter() - started if ok else None


def _probe_until_told(base_url: str, control: Connection) -> None:
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    latencies: list[float] = []
    failures = 0
    control.send("started")
    while not control.poll(0):
        latency = _probe_once(host, port)
        if latency is None:
            failures += 1
        latencies.append(PROBE_TIMEOUT_S if latency is None else latency)
        time.sleep(max(0.0, PROBE_INTERVAL_S - (latencies[-1] if latency is not None else 0.0)))
    control.send((latencies, failures))


@contextlib.contextmanager
def watching_health(base_url: str) -> Iterator[list[HealthReport]]:
    """Probe ``base_url``'s ``/health`` for the duration of the block; the report is appended to the
    yielded list when the block ends (the probe's last answer included)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    probe = context.Process(target=_probe_until_told, args=(base_url, theirs), daemon=True)
    probe.start()
    reports: list[HealthReport] = []
    try:
        assert ours.poll(30), "the /health probe did not start"
        ours.recv()
        yield reports
    finally:
        ours.send("stop")
        got = ours.poll(PROBE_TIMEOUT_S + 5)
        if got:
            latencies, failures = ours.recv()
            reports.append(HealthReport(tuple(latencies), failures))
        probe.join(5)
        if probe.is_alive():
            probe.kill()
