"""Shared fixtures and hypothesis profiles for the whole suite."""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter, which must be chosen before anything
    # imports triton (torch._dynamo does, whenever triton is installed).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import redis
from hypothesis import settings

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, written once per test session."""
    from metrale.worker.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


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
