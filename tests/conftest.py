"""Shared fixtures and hypothesis profiles for the whole suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter, which must be chosen before anything
    # imports triton (torch._dynamo does, whenever triton is installed).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import redis
from hypothesis import settings

from metrale.worker.kernels import ops
from tests.failover.cluster import ClusterGroup
from tests.redis_kinds import HarnessRedis

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def kernel_backend_restored() -> Iterator[None]:
    """Each test leaves the process's kernel backend as it found it: building a worker sets its settings'
    backend (``MET_KERNELS``; the worker tests' is ``torch``) process-wide, and every later test would
    otherwise run under it."""
    previous = ops.kernel_backend()
    yield
    ops.set_kernel_backend(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, written once per test session."""
    from metrale.worker.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


TINY_FAMILIES = ("kimi_linear", "qwen3_5", "qwen3_5_moe", "qwen3_next")
"""The families the exactness suite runs over, each as the tiny model ``met model init-tiny`` writes."""


@pytest.fixture(scope="session")
def tiny_family_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """A tiny model folder per family name, each written at most once per session (on first use)."""
    return {"kimi_linear": tiny_model_dir}


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def family_model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_family_dirs: dict[str, Path]
) -> Path:
    """The tiny model of each served family in turn: a test taking it runs once per family."""
    family = str(request.param)
    if family not in tiny_family_dirs:
        from metrale.worker.model.families.qwen3_5_tiny import write_tiny_qwen3_5
        from metrale.worker.model.families.qwen3_next_tiny import write_tiny_qwen3_next

        directory = tmp_path_factory.mktemp(f"tiny-{family}")
        if family == "qwen3_next":
            tiny_family_dirs[family] = write_tiny_qwen3_next(directory)
        else:
            tiny_family_dirs[family] = write_tiny_qwen3_5(directory, moe=family == "qwen3_5_moe")
    return tiny_family_dirs[family]


@pytest.fixture
def real_redis_url() -> str:
    """The real test Redis (``MET_TEST_REDIS_URL``, database 15), flushed; fails, never skips, when it
    is unreachable. Tests still use their own ``Keys(namespace=...)``: other test runs share the db."""
    url = os.environ.get("MET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        if client.connection_pool.connection_kwargs.get("db") != 15:
            pytest.fail(f"refusing to flush {url}: the test Redis must use database 15")
        client.ping()
        client.flushdb()
    except redis.ConnectionError as exc:
        pytest.fail(f"the test Redis at {url} is unreachable: {exc}")
    finally:
        client.close()
    return url


@pytest.fixture(params=["single", "cluster"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """A real Redis of each kind in turn: the test Redis (``real_redis_url``, flushed) and a Redis Cluster
    (``redis_cluster``, one per module). A test connects with ``connect_sync`` / ``connect_async`` and
    names its keys with ``Keys.for_redis(url, namespace)``, as the fleet's processes do."""
    if request.param == "single":
        return str(request.getfixturevalue("real_redis_url"))
    return str(request.getfixturevalue("redis_cluster").url)


@pytest.fixture(params=["fakeredis", "cluster"])
def harness_redis(request: pytest.FixtureRequest) -> HarnessRedis:
    """A gateway harness test runs on fakeredis, then on a Redis Cluster with RQ's jobs on the test Redis
    (``gateway_harness(redis_url=where.url, jobs_redis_url=where.jobs_url)``)."""
    if request.param == "fakeredis":
        return HarnessRedis()
    return HarnessRedis(request.getfixturevalue("redis_cluster").url, request.getfixturevalue("real_redis_url"))


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterGroup]:
    """Three primaries and three replicas in one Redis Cluster of real ``redis-server`` processes, shared
    by a module's tests (a test that kills a node leaves the cluster one replica short: put it last)."""
    group = ClusterGroup(tmp_path_factory.mktemp("cluster"))
    try:
        group.start()
        yield group
    finally:
        group.stop()
