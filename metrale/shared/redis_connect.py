"""Every Redis client of Metrale is made here, from a ``MET_REDIS_URL`` (forms in ``redis_url.py``).

``sync_client(url)`` gives a ``redis.Redis``, ``async_client(url)`` a ``redis.asyncio.Redis``. Both retry a
command that meets a connection error or timeout with redis-py's capped exponential backoff
(``Retry``/``ExponentialBackoff``), reconnecting first; through sentinels (``redis+sentinel://``) every
new connection asks them where the primary is, so after a failover the retries reach the replica they
promoted. A pub/sub object of either client resubscribes its channels when it reconnects.

A Redis Cluster (``redis+cluster://``) has clients of its own: ``sync_cluster_client`` and
``async_cluster_client`` give redis-py's ``RedisCluster`` twins, which route each command to the primary
owning its key's slot, follow ``MOVED`` after a replica is promoted, and serve sharded pub/sub
(``SPUBLISH``/``SSUBSCRIBE``, kept on the shard that owns the channel through failovers).
``sync_client``/``async_client`` refuse a cluster URL (``CLUSTER_NOT_SERVED``): their callers send
transactions over keys of several hash slots, which a cluster refuses.

A process whose Redis work is cluster-safe (each transaction in one slot, pub/sub sharded on a cluster)
connects with ``connect_sync`` / ``connect_async``: the cluster client for a cluster URL, the plain (or
sentinel-following) client otherwise; ``is_cluster`` tells them apart afterwards.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from metrale.shared.redis_url import CLUSTER_NOT_SERVED, RedisTarget, parse_redis_url

SyncClient = redis.Redis | redis.cluster.RedisCluster
"""What ``connect_sync`` gives: one Redis (or a sentinel-named primary), or a Redis Cluster."""
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster
"""What ``connect_async`` gives."""

RETRIES = 5
"""Retries of one command: with the backoff below about 3 s of waiting, longer than a sentinel failover
with ``down-after-milliseconds`` 1000 takes; callers retry past that with their own loop."""
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0


def sync_client(
    url: str | RedisTarget,
    *,
    retries: int = RETRIES,
    socket_timeout: float | None = None,
    socket_connect_timeout: float = 5.0,
    health_check_interval: int = 30,
    max_connections: int | None = None,
) -> redis.Redis:
    """A synchronous client of ``url`` (binary replies) that retries commands through outages and
    follows a sentinel failover."""
    target = _single(url)
    kwargs = _connection_kwargs(target, socket_timeout, socket_connect_timeout, health_check_interval)
    kwargs["retry"] = Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries)
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    if target.follows_failover:
        sentinel = redis.sentinel.Sentinel(target.hosts, sentinel_kwargs=_sentinel_kwargs(target, kwargs))
        return sentinel.master_for(str(target.service), **kwargs)
    return redis.Redis(**kwargs, **_location(target))


def async_client(
    url: str | RedisTarget,
    *,
    retries: int = RETRIES,
    socket_timeout: float | None = None,
    socket_connect_timeout: float = 5.0,
    health_check_interval: int = 30,
    max_connections: int | None = None,
) -> redis.asyncio.Redis:
    """The asyncio twin of ``sync_client``."""
    target = _single(url)
    kwargs = _connection_kwargs(target, socket_timeout, socket_connect_timeout, health_check_interval)
    backoff = ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S)
    kwargs["retry"] = redis.asyncio.retry.Retry(backoff, retries)
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    if target.follows_failover:
        sentinels = redis.asyncio.sentinel.Sentinel(target.hosts, sentinel_kwargs=_sentinel_kwargs(target, kwargs))
        return sentinels.master_for(str(target.service), **kwargs)
    return redis.asyncio.Redis(**kwargs, **_location(target))


def sync_cluster_client(
    url: str | RedisTarget,
    *,
    retries: int = RETRIES,
    socket_timeout: float | None = None,
    socket_connect_timeout: float = 5.0,
    health_check_interval: int = 30,
    max_connections: int | None = None,
) -> redis.cluster.RedisCluster:
    """A synchronous client of the Redis Cluster ``url`` names (binary replies): commands go to the primary
    owning their key's slot, and are retried with the capped backoff through a primary's loss until its
    replica is promoted (the slot map is read again after a connection error or ``MOVED``)."""
    target = _cluster(url)
    kwargs = _connection_kwargs(target, socket_timeout, socket_connect_timeout, health_check_interval)
    del kwargs["db"]  # a cluster has database 0 alone; redis-py refuses the argument
    kwargs["retry"] = Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries)
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    nodes = [redis.cluster.ClusterNode(host, port) for host, port in target.hosts]
    return redis.cluster.RedisCluster(startup_nodes=nodes, **kwargs)


def async_cluster_client(
    url: str | RedisTarget,
    *,
    retries: int = RETRIES,
    socket_timeout: float | None = None,
    socket_connect_timeout: float = 5.0,
    health_check_interval: int = 30,
    max_connections: int | None = None,
) -> redis.asyncio.cluster.RedisCluster:
    """The asyncio twin of ``sync_cluster_client`` (``max_connections`` is per node)."""
    target = _cluster(url)
    kwargs = _connection_kwargs(target, socket_timeout, socket_connect_timeout, health_check_interval)
    del kwargs["db"]
    backoff = ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S)
    kwargs["retry"] = redis.asyncio.retry.Retry(backoff, retries)
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    nodes = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in target.hosts]
    return redis.asyncio.cluster.RedisCluster(startup_nodes=nodes, **kwargs)


def connect_sync(
    url: str | RedisTarget,
    *,
    retries: int = RETRIES,
    socket_timeout: float | None = None,
    socket_connect_timeout: float = 5.0,
    health_check_interval: int = 30,
    max_connections: int | None = None,
) -> SyncClient:
    """A synchronous client of any ``MET_REDIS_URL`` form: ``sync_cluster_client`` for a cluster URL, else
    ``sync_client``. For callers whose every transaction stays in one hash slot."""
    target = parse_redis_url(url) if isinstance(url, str) else url
    make = sync_cluster_client if target.cluster else sync_client
    return make(
        target,
        retries=retries,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        health_check_interval=health_check_interval,
        max_connections=max_connections,
    )


def connect_async(
    url: str | RedisTarget,
    *,
    retries: int = RETRIES,
    socket_timeout: float | None = None,
    socket_connect_timeout: float = 5.0,
    health_check_interval: int = 30,
    max_connections: int | None = None,
) -> AsyncClient:
    """The asyncio twin of ``connect_sync`` (``max_connections`` is per node on a cluster)."""
    target = parse_redis_url(url) if isinstance(url, str) else url
    make = async_cluster_client if target.cluster else async_client
    return make(
        target,
        retries=retries,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        health_check_interval=health_check_interval,
        max_connections=max_connections,
    )


def is_cluster(client: object) -> bool:
    """Whether ``client`` (sync or asyncio) talks to a Redis Cluster."""
    return isinstance(client, redis.cluster.RedisCluster | redis.asyncio.cluster.RedisCluster)


def _single(url: str | RedisTarget) -> RedisTarget:
    target = parse_redis_url(url) if isinstance(url, str) else url
    if target.cluster:
        raise ValueError(CLUSTER_NOT_SERVED)
    return target


def _cluster(url: str | RedisTarget) -> RedisTarget:
    target = parse_redis_url(url) if isinstance(url, str) else url
    if not target.cluster:
        raise ValueError(f"a cluster client needs a redis+cluster:// URL; got {target.display()}")
    return target


def _connection_kwargs(
    target: RedisTarget, socket_timeout: float | None, socket_connect_timeout: float, health_check_interval: int
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "db": target.db,
        "username": target.username,
        "password": target.password,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_connect_timeout,
        "health_check_interval": health_check_interval,
        "retry_on_error": [ConnectionError, TimeoutError],
    }
    if target.tls is not None:
        kwargs |= target.tls.connection_kwargs()
    return kwargs


def _location(target: RedisTarget) -> dict[str, Any]:
    if target.socket_path is not None:
        return {"unix_socket_path": target.socket_path}
    ((host, port),) = target.hosts
    return {"host": host, "port": port}


def _sentinel_kwargs(target: RedisTarget, kwargs: dict[str, Any]) -> dict[str, Any]:
    """How to reach the sentinels themselves: their own credentials, the same timeouts and TLS."""
    sentinel: dict[str, Any] = {
        "username": target.sentinel_username,
        "password": target.sentinel_password,
        "socket_timeout": kwargs["socket_timeout"] or kwargs["socket_connect_timeout"],
        "socket_connect_timeout": kwargs["socket_connect_timeout"],
    }
    if target.tls is not None:
        sentinel |= target.tls.connection_kwargs()
    return sentinel


async def warm_pool(client: redis.asyncio.Redis, connections: int) -> int:
    """Open ``connections`` of ``client``'s pool now, idle for later (its pool otherwise opens one per
    command that finds none free, each a handshake on the caller's event loop, all at once in a burst);
    how many opened. An optimisation only: what fails to open is opened later, on demand."""
    pool = client.connection_pool
    opened = await asyncio.gather(*(pool.get_connection() for _ in range(connections)), return_exceptions=True)
    ready = [connection for connection in opened if not isinstance(connection, BaseException)]
    for connection in ready:
        await pool.release(connection)
    return len(ready)
