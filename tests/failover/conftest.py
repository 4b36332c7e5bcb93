"""Fixtures of the failover tests that run real processes: a private Redis, a primary with a replica and
three sentinels, the reference model (a Redis Cluster: ``redis_cluster`` in ``tests/conftest.py``), and
``fleet_redis_url``: the URL of a private Redis or of a private Redis Cluster, for the fleet tests that
run on both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale.worker.engine.factory import EngineLimits, LoadedModel, build_engine
from tests.failover.cluster import ClusterGroup
from tests.failover.processes import RedisServer
from tests.failover.sentinels import SentinelGroup


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A ``redis-server`` of this test alone (no persistence), stopped at its end."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["single", "cluster"])
def fleet_redis_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A ``redis://`` URL of a ``redis-server`` of this test alone, or a ``redis+cluster://`` URL of a
    Redis Cluster of this test alone (3 primaries, 3 replicas); stopped at its end."""
    if request.param == "single":
        server = RedisServer(tmp_path)
        server.start()
        yield server.url
        server.stop()
        return
    group = ClusterGroup(tmp_path)
    try:
        group.start()
        yield group.url
    finally:
        group.stop()


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelGroup]:
    """A primary, a replica and three ``redis-sentinel`` processes of this test alone, stopped at its end."""
    group = SentinelGroup(tmp_path)
    try:
        group.start()
        yield group
    finally:
        group.stop()


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model loaded here: what an undisturbed run of each request produces."""
    return build_engine(tiny_model_dir, EngineLimits(max_seqs=128, num_blocks=2048))
