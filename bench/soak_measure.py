"""What the soak benchmark measures besides requests: the resident memory of every process over time
(and the least-squares slope of it after a warm-up), and the Redis keys a fleet leaves behind.

Pure helpers (``slope_mib_per_min``, ``classify_keys``, ``key_family``) take plain values, so they are
tested without processes or Redis; ``RssSampler`` and ``scan_keys`` read ``/proc`` and Redis.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import redis

from metrale.shared.keys import LOST_WORKER_MEMORY_S, Keys

MIB = 1024 * 1024


def slope_mib_per_min(samples: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of ``(seconds, bytes)`` samples in MiB per minute; ``None`` for fewer
    than two samples or samples all at one time."""
    if len(samples) < 2:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    if spread == 0:
        return None
    covariance = sum((t - mean_t) * (y - mean_y) for t, y in samples)
    return covariance / spread / MIB * 60


def rss_bytes(pid: int) -> int | None:
    """The resident set size of ``pid`` (``VmRSS`` of ``/proc/{pid}/status``), ``None`` once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


@dataclass
class Series:
    """The RSS samples of one process from its start: ``(seconds since its start, bytes)``."""

    name: str
    pid: int
    started_at: float
    samples: list[tuple[float, int]] = field(default_factory=list)

    def after(self, warmup_s: float) -> list[tuple[float, float]]:
        """The samples taken at least ``warmup_s`` after the process started."""
        return [(t, float(y)) for t, y in self.samples if t >= warmup_s]


@dataclass(frozen=True)
class RssSummary:
    """One process's memory over the run: first and last sample, peak, slope after the warm-up."""

    name: str
    pid: int
    lived_s: float
    first_mib: float
    last_mib: float
    peak_mib: float
    samples_after_warmup: int
    slope_mib_per_min: float | None


def summarize(series: Series, warmup_s: float, min_samples: int) -> RssSummary | None:
    """``series`` in numbers; the slope only with at least ``min_samples`` samples after the warm-up."""
    if not series.samples:
        return None
    values = [y for _, y in series.samples]
    kept = series.after(warmup_s)
    slope = slope_mib_per_min(kept) if len(kept) >= min_samples else None
    return RssSummary(
        series.name,
        series.pid,
        series.samples[-1][0],
        values[0] / MIB,
        values[-1] / MIB,
        max(values) / MIB,
        len(kept),
        slope,
    )


class RssSampler:
    """Samples the RSS of every process ``processes()`` names (name -> pid) every ``every_s``, in a
    thread. A new pid under a known name (a restart) starts a new series."""

    def __init__(self, processes: Callable[[], Mapping[str, int]], every_s: float) -> None:
        self.series: list[Series] = []
        self._processes, self._every_s = processes, every_s
        self._current: dict[str, Series] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self) -> None:
        now = time.monotonic()
        for name, pid in self._processes().items():
            size = rss_bytes(pid)
            if size is None:
                continue
            with self._lock:
                series = self._current.get(name)
                if series is None or series.pid != pid:
                    series = self._current[name] = Series(name, pid, now)
                    self.series.append(series)
                series.samples.append((now - series.started_at, size))

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            with contextlib.suppress(Exception):  # a process that exits between listing and reading
                self.sample()


# -- Redis keys --------------------------------------------------------------------------------

TTL_FAMILIES = frozenset({"run", "run-events", "ckpt", "session", "session-transcript", "resp", "worker"})
"""Key families that must always carry a TTL: a key of one without is never reclaimed."""


def key_family(key: str, namespace: str) -> str:
    """The family of a Redis key: ``run``, ``run-events``, ``batch-results``, ``req:interactive`` ...,
    ``rq`` for RQ's own keys, ``other`` for anything outside ``namespace``."""
    if key.startswith("rq:"):
        return "rq:" + key.split(":")[1]
    if key == f"{namespace}.batches" or not key.startswith(f"{namespace}:"):
        return "other"
    parts = key[len(namespace) + 1 :].split(":")
    head = parts[0]
    if head == "run":
        return "run-events" if parts[-1] == "events" and len(parts) > 2 else "run"
    if head == "batch":
        return "batch-results" if parts[-1] == "results" and len(parts) > 3 else "batch"
    if head == "session":
        return "session-transcript" if parts[-1] == "transcript" and len(parts) > 3 else "session"
    if head in ("req", "metrics", "running"):
        return ":".join(parts[:2])
    return head


@dataclass(frozen=True)
class KeyInfo:
    """One key as scanned: its name and TTL in seconds (-1: none)."""

    key: str
    ttl_s: int


@dataclass
class KeyScan:
    """The fleet's keys at one moment and what is wrong with them (``leaks``: one line each)."""

    families: dict[str, int]
    without_ttl: dict[str, int]
    leaks: list[str]


@dataclass(frozen=True)
class FleetFacts:
    """What the classification needs to know beyond the keys: entries of sets and streams that must
    be empty once the fleet is idle, and the batches that ended."""

    running: int = 0
    running_info: int = 0
    active_batches: Sequence[str] = ()
    terminal_batches: frozenset[str] = frozenset()
    """``{tenant}:{batch id}`` of every batch whose status is terminal."""
    stream_lengths: Mapping[str, int] = field(default_factory=dict)
    stream_pending: Mapping[str, int] = field(default_factory=dict)
    lost_worker_ages_s: Sequence[float] = ()


def classify_keys(keys: Iterable[KeyInfo], namespace: str, facts: FleetFacts) -> KeyScan:
    """Counts by family, keys without a TTL by family, and leaks: a key of a ``TTL_FAMILIES`` family
    with no TTL, requests still in the running index of an idle fleet, finished batches still
    listed as active or still holding their per-line results, stream entries left behind (queued or
    pending), lost workers remembered longer than ``LOST_WORKER_MEMORY_S``."""
    families: dict[str, int] = {}
    without_ttl: dict[str, int] = {}
    leaks: list[str] = []
    for info in keys:
        family = key_family(info.key, namespace)
        families[family] = families.get(family, 0) + 1
        if info.ttl_s == -1:
            without_ttl[family] = without_ttl.get(family, 0) + 1
            if family in TTL_FAMILIES:
                leaks.append(f"{info.key}: no TTL")
        if family == "batch-results":
            batch = info.key[len(namespace) + 1 :].split(":", 1)[1].rsplit(":", 1)[0]
            if batch in facts.terminal_batches:
                leaks.append(f"{info.key}: results of a finished batch")
    if facts.running or facts.running_info:
        leaks.append(f"running index: {facts.running} requests, {facts.running_info} infos in an idle fleet")
    leaks += [
        f"active-batches: {member} has ended" for member in facts.active_batches if member in facts.terminal_batches
    ]
    for stream, length in facts.stream_lengths.items():
        if length or facts.stream_pending.get(stream, 0):
            leaks.append(f"{stream}: {length} entries, {facts.stream_pending.get(stream, 0)} pending in an idle fleet")
    stale = [age for age in facts.lost_worker_ages_s if age > LOST_WORKER_MEMORY_S + 60]
    if stale:
        leaks.append(f"worker index: {len(stale)} lost workers older than {LOST_WORKER_MEMORY_S} s")
    return KeyScan(dict(sorted(families.items())), dict(sorted(without_ttl.items())), leaks)


def scan_keys(client: redis.Redis, keys: Keys) -> KeyScan:
    """Scan every key of ``keys``' namespace and of RQ, read the facts, classify."""
    found = [
        *client.scan_iter(match=f"{keys.namespace}:*", count=1000),
        *client.scan_iter(match="rq:*", count=1000),
    ]
    with client.pipeline(transaction=False) as pipe:
        for key in found:
            pipe.ttl(key)
        ttls = pipe.execute()
    infos = [KeyInfo(_text(key), int(ttl)) for key, ttl in zip(found, ttls, strict=True) if ttl != -2]
    return classify_keys(infos, keys.namespace, fleet_facts(client, keys, [info.key for info in infos]))


def fleet_facts(client: redis.Redis, keys: Keys, names: Sequence[str]) -> FleetFacts:
    """The running index, active batches, terminal batches, stream depths and lost workers."""
    terminal = set()
    prefix = f"{keys.namespace}:batch:"
    for name in names:
        rest = name[len(prefix) :] if name.startswith(prefix) else ""
        if rest and not rest.endswith(":results"):
            status = client.hget(name, "status")
            if status is not None and _text(status) in ("completed", "failed", "cancelled", "expired"):
                terminal.add(rest)
    lengths, pending = {}, {}
    for priority in ("interactive", "batch"):
        stream = f"{keys.namespace}:req:{priority}"
        if client.exists(stream):
            lengths[stream] = int(client.xlen(stream))
            groups = client.xinfo_groups(stream)
            pending[stream] = sum(int(group["pending"]) for group in groups)
    now = time.time()
    indexed = cast(list[tuple[bytes, float]], client.zrange(keys.worker_index(), 0, -1, withscores=True))
    ages = [now - score for member, score in indexed if not client.exists(keys.worker(_text(member)))]
    return FleetFacts(
        running=int(client.zcard(keys.running_index())),
        running_info=int(client.hlen(keys.running_info())),
        active_batches=[_text(m) for m in cast(list[bytes], client.zrange(keys.active_batches(), 0, -1))],
        terminal_batches=frozenset(terminal),
        stream_lengths=lengths,
        stream_pending=pending,
        lost_worker_ages_s=ages,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
