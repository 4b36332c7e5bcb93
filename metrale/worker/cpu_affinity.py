"""Which CPUs a worker runs on (``met worker --cpus``).

A worker shares a machine with gateways, Redis and other workers; on the CPU its steps are fastest
on cores of their own, where no other process's work evicts the model from the caches between steps
(``docs/BENCHMARKS.md``: on two cores, with the worker pinned to one and the gateway, Redis and the
client to the other, the worker spent 10-15 % less CPU per token and the fleet made 5-10 % more tokens
per second at one stream). ``pin`` restricts the process, and
every thread it starts afterwards, to a list of CPUs written as Linux writes them (``0-3,8``).
"""

from __future__ import annotations

import os


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
