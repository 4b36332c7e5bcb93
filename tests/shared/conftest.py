"""Redis clients for the shared tests: an in-process fakeredis and the real test server.

The real server is ``MET_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/15``). Its database is
flushed before each test, so the fixture refuses any database but 15, and it fails (does not skip)
when the server is unreachable: a missing Redis is a broken test environment, not a reason to pass.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import fakeredis
import pytest
import redis
import redis.asyncio

TEST_REDIS_URL = os.environ.get("MET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
TEST_REDIS_DB = 15

AsyncClientFactory = Callable[[], AbstractAsyncContextManager[redis.asyncio.Redis]]


@pytest.fixture
def real_redis() -> Iterator[redis.Redis]:
    """A client of the real test Redis, on a freshly flushed database 15."""
    client = redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=2, socket_timeout=5)
    if client.connection_pool.connection_kwargs.get("db") != TEST_REDIS_DB:
        pytest.fail(f"refusing to flush {TEST_REDIS_URL}: the test Redis must use database {TEST_REDIS_DB}")
    try:
        client.ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"the test Redis at {TEST_REDIS_URL} is unreachable: {exc}")
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def fake_server() -> fakeredis.FakeServer:
    """One in-process fake Redis server, shared by the sync and asyncio fake clients of a test."""
    return fakeredis.FakeServer()


@pytest.fixture(params=["fakeredis", pytest.param("redis", marks=pytest.mark.redis)])
def redis_client(request: pytest.FixtureRequest, fake_server: fakeredis.FakeServer) -> redis.Redis:
    """The same test against fakeredis and against the real test Redis (marked ``redis``)."""
    if request.param == "redis":
        client: redis.Redis = request.getfixturevalue("real_redis")
        return client
    return fakeredis.FakeRedis(server=fake_server)


@pytest.fixture
def async_redis_client(redis_client: redis.Redis, fake_server: fakeredis.FakeServer) -> AsyncClientFactory:
    """Opens an asyncio client on the same server as ``redis_client`` (inside the test's event loop)."""

    @asynccontextmanager
    async def open_client() -> AsyncIterator[redis.asyncio.Redis]:
        if isinstance(redis_client, fakeredis.FakeRedis):
            client: redis.asyncio.Redis = fakeredis.FakeAsyncRedis(server=fake_server)
        else:
            client = redis.asyncio.Redis.from_url(TEST_REDIS_URL)
        try:
            yield client
        finally:
            await client.aclose()

    return open_client
