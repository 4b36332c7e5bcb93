"""The fleet under test, started once for the whole package: real ``met worker`` and ``met gateway``
processes on the real test Redis, in a key namespace of their own, serving the random-weight tiny
model (``MET_MODEL_DIR``); and that model loaded here too, as the offline reference their output must
equal.

The fleet's Redis is the test server's database 15 but, unlike ``real_redis_url``, it is not flushed:
a flush between two tests would wipe the running worker's announcement and consumer groups.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from metrale.worker.engine.factory import EngineLimits, LoadedModel, build_engine
from metrale.worker.fleet.broker.redis_transport import redis_client
from metrale.worker.model.builtin import random_model_dir
from tests.failover.cluster import ClusterGroup
from tests.integration.deployments import HEARTBEAT_TTL_S, MAX_SEQS, Fleet, running_fleet


@pytest.fixture(scope="package")
def integration_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Logs and the model cache of the processes this package starts."""
    return tmp_path_factory.mktemp("integration")


@pytest.fixture(scope="package")
def model_settings(integration_dir: Path) -> dict[str, str]:
    """``MET_MODEL_DIR`` (the random-weight tiny model, written once so no process races to write it)
    and ``MET_CACHE_DIR`` of the processes this package starts."""
    cache = integration_dir / "cache"
    return {"MET_CACHE_DIR": str(cache), "MET_MODEL_DIR": str(random_model_dir(cache))}


@pytest.fixture(scope="package")
def reference_model(model_settings: dict[str, str]) -> LoadedModel:
    """The served model loaded in this process: the offline engine the fleet's output must equal."""
    directory = Path(model_settings["MET_MODEL_DIR"])
    return build_engine(directory, EngineLimits(max_seqs=MAX_SEQS, num_blocks=1024))


@pytest.fixture(scope="package")
def fleet_redis_url() -> str:
    """The real test Redis (``MET_TEST_REDIS_URL``, database 15), checked to answer; never skipped."""
    url = os.environ.get("MET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        if client.connection_pool.connection_kwargs.get("db") != 15:
            pytest.fail(f"refusing to use {url}: the test Redis must use database 15")
        client.ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"the test Redis at {url} is unreachable: {exc}")
    finally:
        client.close()
    return url


@pytest.fixture(scope="package")
def fleet(fleet_redis_url: str, model_settings: dict[str, str], integration_dir: Path) -> Iterator[Fleet]:
    """``met worker`` (``MAX_SEQS`` slots) and ``met gateway`` on the real Redis, for the package."""
    settings = {**model_settings, "MET_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S)}
    worker_args = ["--max-seqs", str(MAX_SEQS), "--num-blocks", "1024"]
    with running_fleet(fleet_redis_url, integration_dir, settings=settings, worker_args=worker_args) as running:
        yield running


@pytest.fixture(scope="package")
def cluster_fleet(model_settings: dict[str, str], integration_dir: Path) -> Iterator[Fleet]:
    """The same fleet on a Redis Cluster of its own (3 primaries + 3 replicas), for the package."""
    log_dir = integration_dir / "on-cluster"
    log_dir.mkdir()
    group = ClusterGroup(log_dir)
    settings = {**model_settings, "MET_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S)}
    worker_args = ["--max-seqs", str(MAX_SEQS), "--num-blocks", "1024"]
    try:
        group.start()
        with running_fleet(group.url, log_dir, settings=settings, worker_args=worker_args) as running:
            yield running
    finally:
        group.stop()


@pytest.fixture(params=["single", "cluster"])
def any_fleet(request: pytest.FixtureRequest) -> Fleet:
    """``fleet`` (one Redis) or ``cluster_fleet`` (a Redis Cluster): a test taking it runs on both."""
    return cast(Fleet, request.getfixturevalue("fleet" if request.param == "single" else "cluster_fleet"))


@pytest.fixture
def any_fleet_redis(any_fleet: Fleet) -> Iterator[redis.Redis]:
    """A client of ``any_fleet``'s Redis (binary replies; on a cluster, redis-py's cluster client, which
    answers the same single-key reads)."""
    client = redis_client(any_fleet.redis_url)
    yield cast(redis.Redis, client)
    client.close()


@pytest.fixture
def fleet_redis(fleet: Fleet) -> Iterator[redis.Redis]:
    """A client of the fleet's Redis (binary replies, as the record readers expect)."""
    client = redis_client(fleet.redis_url)
    yield client
    client.close()
