"""Hand-packed transactions (``resp.py``) on a Redis Cluster: each sent to the primary owning its slot.

A cluster runs a ``MULTI`` only when every key in it shares one hash slot (else ``CROSSSLOT``), and only on
the primary that owns the slot (else ``MOVED``). ``SlotRouter`` finds that primary in the cluster
client's slot map and sends the transaction there with ``resp.execute_transaction`` / ``send_transaction``
on that node's own pool. When the slot's owner has changed (``MOVED``: a replica was promoted or the slot
migrated; ``CLUSTERDOWN``/``TRYAGAIN`` while the cluster elects one) or its primary is unreachable, the
slot map is read again and the transaction retried with the capped backoff, so a primary's ``kill -9``
costs the ``cluster-node-timeout`` and the election, then the writes continue on the promoted replica.
A transaction refused with ``MOVED``/``CLUSTERDOWN``/``TRYAGAIN`` never ran; one cut off by a connection
error may have run, as on a single Redis (the publisher's idempotent re-send covers both).

``redis_transport.py`` sends each shard's publish transaction through ``send`` with a key of that shard,
and retries it itself, only when the shard's primary lacks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import redis
import redis.cluster
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    MovedError,
    SlotNotCoveredError,
    TimeoutError,
    TryAgainError,
)
from redis.retry import Retry

from metrale.shared.redis_connect import BACKOFF_BASE_S, BACKOFF_CAP_S
from metrale.worker.fleet.broker.resp import SentTransaction, Transaction, execute_transaction, send_transaction

FAILOVER_RETRIES = 12
"""Retries of one transaction while its slot has no reachable primary: with the backoff about 15 s,
several times a ``cluster-node-timeout`` of a few seconds and the election after it."""
T = TypeVar("T")
REROUTED = (ConnectionError, TimeoutError, MovedError, ClusterDownError, TryAgainError, SlotNotCoveredError)


class SlotRouter:
    """Sends transactions of one slot each to the primary that owns it now, following failovers."""

    def __init__(self, cluster: redis.cluster.RedisCluster, *, retries: int = FAILOVER_RETRIES) -> None:
        self._cluster = cluster
        self._retry = Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries, REROUTED)

    def primary_for(self, key: str | bytes) -> redis.Redis:
        """The client of the primary owning ``key``'s slot, as the slot map says now."""
        slot = self._cluster.keyslot(key)
        node = self._cluster.nodes_manager.get_node_from_slot(slot)
        return self._cluster.get_redis_connection(node)

    def execute(self, key: str | bytes, transaction: Transaction) -> list[Any]:
        """``EXEC``'s replies of ``transaction``, whose keys all share ``key``'s slot, run on its primary."""
        return self._retry.call_with_retry(
            lambda: execute_transaction(self.primary_for(key), transaction), self._reroute
        )

    def send(self, key: str | bytes, transaction: Transaction) -> SentTransaction:
        """Send ``transaction`` (not empty) to the primary of ``key``'s slot; its replies are read later
        (``SentTransaction.replies``), without retries: a transaction sent once may have run."""
        return send_transaction(self.primary_for(key), transaction)

    def call(self, action: Callable[[], T]) -> T:
        """``action()``, which sends commands through ``primary_for``, retried as a transaction is: after a
        ``MOVED`` reply or a lost node, with the slot map read again. ``action`` must be safe to repeat."""
        return self._retry.call_with_retry(action, self._reroute)

    def refresh(self) -> None:
        """Read the slot map again (after a ``MOVED`` reply the caller met itself)."""
        self._cluster.nodes_manager.initialize()

    def refresh_quietly(self) -> None:
        """``refresh``, unless no node answers yet (then the next attempt's caller tries again)."""
        with contextlib.suppress(ConnectionError, TimeoutError, ClusterDownError, redis.RedisClusterException):
            self.refresh()

    def _reroute(self, error: Exception) -> None:
        self.refresh_quietly()
