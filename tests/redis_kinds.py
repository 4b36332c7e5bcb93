"""Which real Redis a test runs on, for the tests parametrized over one Redis and a Redis Cluster (issue
#34); the fixtures that hand them out live in ``tests/conftest.py``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HarnessRedis:
    """Where a gateway harness keeps the fleet's state: fakeredis (``url`` None), or a real Redis (one, or a
    Redis Cluster) with RQ's jobs on ``jobs_url`` (the test Redis beside a cluster, as a fleet on one runs)."""

    url: str | None = None
    jobs_url: str | None = None
