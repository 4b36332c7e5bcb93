"""Batch tests run on asyncio, and on the fleet's Redis of each kind: one Redis, then a Redis Cluster, RQ's
jobs on the test Redis either way (``MET_JOBS_REDIS_URL`` beside a cluster)."""

from __future__ import annotations

import pytest

from tests.redis_kinds import HarnessRedis


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def fleet_redis(any_redis_url: str, real_redis_url: str) -> HarnessRedis:
    return HarnessRedis(any_redis_url, real_redis_url)
