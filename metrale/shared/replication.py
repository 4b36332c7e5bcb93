"""Writes that must survive a failover: ``WAIT`` until replicas hold them, and write again what a
promoted replica lacks.

Redis replicates asynchronously: a write the primary acknowledged can be gone from the replica the
sentinels promote when the primary dies. For the writes a request cannot lose — the gateway's queue
entry and record, a worker's events and final status — the writer sends ``WAIT replicas timeout``
after the write (``Replication``; ``MET_REDIS_WAIT_REPLICAS=0``, the default, sends none). When fewer
replicas confirm in time, either the primary died and the retried ``WAIT`` reached the promoted one,
or a replica lags or is gone: the writer asks the primary that answers now whether the write is there
(``missing``) and, if not, makes it again (``write``; every such write is idempotent for its readers).
With no replica to wait for, waiting buys nothing (no replica, no failover), so after a shortfall a
``ReplicaWaiter`` stops waiting for ``PAUSE_S`` and says so in the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis
import redis.asyncio

logger = logging.getLogger(__name__)

PAUSE_S = 1.0
"""How long a waiter skips its waits after replicas fell short (a lone primary would otherwise make
every write wait the whole timeout)."""


@dataclass(frozen=True, slots=True)
class Replication:
    """How many replicas must acknowledge a write that must survive a failover (0: none, no ``WAIT``)
    and how long a writer waits for them."""

    replicas: int = 0
    timeout_ms: int = 100

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.timeout_ms < 1:
            raise ValueError("redis_wait_replicas must be >= 0 and redis_wait_timeout_ms >= 1")


NO_WAIT = Replication()
"""The default: no ``WAIT`` (a single Redis, or one whose replicas may lose the newest writes)."""


class ReplicaWaiter:
    """Confirms one client's writes on ``replication.replicas`` replicas (thread-safe enough: its only
    state is the end of a pause, and a race only waits once more or once less).

    ``WAIT`` counts the replicas that hold its own connection's newest write, and a pooled client may
    have made the write to confirm on another connection: so the ``WAIT`` goes out in one pipeline
    behind an ``INCR`` of ``mark_key`` — a write on its own connection that comes after the one to
    confirm, and that a replica holds only if it holds everything before."""

    def __init__(self, replication: Replication, mark_key: str) -> None:
        self.replication = replication
        self.mark_key = mark_key
        self.shortfalls = 0
        self._paused_until = 0.0

    @property
    def active(self) -> bool:
        """Whether the next write should be confirmed."""
        return self.replication.replicas > 0 and time.monotonic() >= self._paused_until

    def confirm(self, client: redis.Redis, *, missing: Callable[[], bool], write: Callable[[], object]) -> bool:
        """After ``write`` ran once on ``client``: whether the replicas confirmed it. On a shortfall,
        ``write`` runs again when ``missing()`` says the primary that answers now lacks it."""
        if not self.active:
            return False
        acknowledged = self.acknowledgements(client)
        if acknowledged >= self.replication.replicas:
            return True
        if missing():
            logger.warning("a write was lost with the Redis primary; writing it again")
            write()
        self._pause(acknowledged)
        return False

    async def confirm_async(
        self,
        client: redis.asyncio.Redis,
        *,
        missing: Callable[[], Awaitable[bool]],
        write: Callable[[], Awaitable[object]],
    ) -> bool:
        """The asyncio twin of ``confirm``."""
        if not self.active:
            return False
        acknowledged = await self.acknowledgements_async(client)
        if acknowledged >= self.replication.replicas:
            return True
        if await missing():
            logger.warning("a write was lost with the Redis primary; writing it again")
            await write()
        self._pause(acknowledged)
        return False

    def acknowledgements(self, client: redis.Redis) -> int:
        """How many replicas hold every write ``client`` made so far (waiting up to the timeout)."""
        with client.pipeline(transaction=False) as pipe:
            pipe.incr(self.mark_key)
            pipe.wait(self.replication.replicas, self.replication.timeout_ms)
            return int(pipe.execute()[-1])

    async def acknowledgements_async(self, client: redis.asyncio.Redis) -> int:
        """The asyncio twin of ``acknowledgements``."""
        async with client.pipeline(transaction=False) as pipe:
            pipe.incr(self.mark_key)
            pipe.wait(self.replication.replicas, self.replication.timeout_ms)
            return int((await pipe.execute())[-1])

    def _pause(self, acknowledged: int) -> None:
        self.shortfalls += 1
        self._paused_until = time.monotonic() + PAUSE_S
        logger.warning(
            "%d of %d Redis replicas confirmed a write within %d ms; writes go unconfirmed for %.0f s",
            acknowledged,
            self.replication.replicas,
            self.replication.timeout_ms,
            PAUSE_S,
        )
