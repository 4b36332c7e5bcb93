"""Which CPUs a worker runs on (``met worker --cpus``).

A worker shares a machine with gateways, Redis and other workers; on the CPU its steps are fastest
on cores of their own, where no other process's work evicts the model from the caches between steps
(``docs/BENCHMARKS.md``: on two cores, with the worker pinned to one and the gateway, Redis and the
client to the other, the worker spent 10-15 % less CPU per token and the fleet made 5-10 % more tokens
per second at one stream). ``pin`` restricts the process, and
every thread it starts afterwards, to a list of CPUs written as Linux writes them (``0-3,8``).

``usable_cpus`` is how many threads a worker's torch should run: the CPUs it may run on, capped by its
cgroup's CPU quota. A container limited to 2 CPUs (``docker run --cpus 2``, compose's ``cpus:``) on a
64-core host still sees 64 CPUs, and torch would start a thread for each; throttled to 2 CPUs' worth of
time, every operator then waits on threads that are not running.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list: numbers and ranges separated by commas (``0-3,8`` -> {0,1,2,3,8})."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"{text!r} is not a CPU list: write CPUs as 0-3,8") from None
        if low < 0 or high < low:
            raise ValueError(f"{part.strip()!r} in {text!r} is not a CPU range: write it low-high, e.g. 0-3")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def pin(cpus: frozenset[int]) -> None:
    """Run this process, and the threads it starts from now on, on ``cpus`` only: any of the CPUs the
    system lets it use (its cgroup's), not only those it was started on."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--cpus needs Linux (os.sched_setaffinity)")
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        raise ValueError(f"CPUs {_listed(sorted(cpus))} are not available here") from None
    missing = sorted(cpus - os.sched_getaffinity(0))  # the system drops the CPUs it does not allow
    if missing:
        raise ValueError(f"CPUs {_listed(missing)} are not available here")


def _listed(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process can keep busy: those it may run on, capped by its cgroup's CPU quota
    (rounded down, at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        membership = proc_cgroup.read_text()
    except OSError:
        return cpus
    quota = cgroup_cpu_quota(cgroup_root, membership)
    return cpus if quota is None else max(1, min(cpus, math.floor(quota)))


def cgroup_cpu_quota(cgroup_root: Path, membership: str) -> float | None:
    """The CPU quota, in CPUs, of the cgroups listed in ``membership`` (the text of
    ``/proc/self/cgroup``), or None when none is set: the smallest ``cpu.max`` (cgroup v2) or
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (v1) on the way from the process's cgroup up to the
    hierarchy's root. Inside a container the root is the container's own cgroup."""
    quotas: list[float] = []
    for line in membership.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            quotas += _quotas(cgroup_root, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            quotas += _quotas(cgroup_root / controllers, path, _v1_quota)
    return min(quotas, default=None)


def _quotas(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas set on ``path`` and each of its parents under ``mount``."""
    directory = mount / path.strip("/")
    found = []
    for candidate in [directory, *directory.parents]:
        if not candidate.is_relative_to(mount):
            break
        quota = read(candidate)
        if quota is not None:
            found.append(quota)
    return found


def _v2_quota(directory: Path) -> float | None:
    try:
        limit, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        quota, length = (None, 1) if limit == "max" else (int(limit), int(period or 100_000))
    except (OSError, ValueError):
        return None
    return None if quota is None or quota <= 0 or length <= 0 else quota / length


def _v1_quota(directory: Path) -> float | None:
    try:
        limit = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if limit <= 0 or period <= 0 else limit / period
