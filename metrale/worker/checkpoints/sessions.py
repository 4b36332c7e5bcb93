"""A session's newest checkpoint: which prefix it covers, how big, when last used, in which tier."""

from __future__ import annotations

import threading
from typing import Protocol

import redis

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import SyncClient
from metrale.shared.sessions import RETOKENIZED_FIELD, SessionEntry
from metrale.worker.checkpoints.store import StoreUnavailable


class SessionIndex(Protocol):
    def get(self, tenant: str, session_id: str) -> SessionEntry | None: ...

    def record(self, tenant: str, session_id: str, entry: SessionEntry) -> None: ...

    def delete(self, tenant: str, session_id: str) -> bool: ...

    def count_retokenized(self, tenant: str, session_id: str) -> None:
        """One more lookup of the session whose newest checkpoint was not a prefix of the prompt."""
        ...


class MemorySessions:
    """Sessions of one process (offline use and tests)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], SessionEntry] = {}
        self.retokenized: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str, session_id: str) -> SessionEntry | None:
        with self._lock:
            return self._entries.get((tenant, session_id))

    def record(self, tenant: str, session_id: str, entry: SessionEntry) -> None:
        with self._lock:
            self._entries[(tenant, session_id)] = entry

    def delete(self, tenant: str, session_id: str) -> bool:
        with self._lock:
            self.retokenized.pop((tenant, session_id), None)
            return self._entries.pop((tenant, session_id), None) is not None

    def count_retokenized(self, tenant: str, session_id: str) -> None:
        with self._lock:
            self.retokenized[(tenant, session_id)] = self.retokenized.get((tenant, session_id), 0) + 1


class RedisSessions:
    """Sessions shared by the fleet: ``met:session:{tenant}:{sid}`` hashes with a TTL (each transaction over
    one session's hash: one slot on a Redis Cluster, the tenant's)."""

    def __init__(self, client: SyncClient, keys: Keys, ttl_s: int = 3600) -> None:
        self.client, self.keys, self.ttl_s = client, keys, ttl_s

    def get(self, tenant: str, session_id: str) -> SessionEntry | None:
        try:
            raw = self.client.hgetall(self.keys.session(tenant, session_id))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        return SessionEntry.from_fields(raw) if raw else None

    def record(self, tenant: str, session_id: str, entry: SessionEntry) -> None:
        key = self.keys.session(tenant, session_id)
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=entry.to_fields())  # type: ignore[arg-type]
                pipe.expire(key, self.ttl_s)
                pipe.execute()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    def delete(self, tenant: str, session_id: str) -> bool:
        try:
            return bool(self.client.delete(self.keys.session(tenant, session_id)))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    def count_retokenized(self, tenant: str, session_id: str) -> None:
        """``HINCRBY retokenized`` on the session's hash (``record`` leaves that field alone)."""
        key = self.keys.session(tenant, session_id)
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.hincrby(key, RETOKENIZED_FIELD, 1)
                pipe.expire(key, self.ttl_s)
                pipe.execute()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
