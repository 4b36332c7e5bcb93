"""Fixtures of the failover tests that run real processes: a private Redis, a primary with a replica and
three sentinels, the reference model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale.worker.engine.factory import EngineLimits, LoadedModel, build_engine
from tests.failover.processes import RedisServer
from tests.failover.sentinels import SentinelGroup


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A ``redis-server`` of this test alone (no persistence), stopped at its end."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


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
