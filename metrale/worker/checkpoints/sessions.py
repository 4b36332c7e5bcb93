"""A session's newest checkpoint: which prefix it covers, how big, when last used, in which tier."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import redis

from metrale.shared.keys import Keys
from metrale.worker.checkpoints.store import StoreUnavailable


@dataclass(frozen=True, slots=True)
class SessionEntry:
    length: int
    token_hash: str
    nbytes: int
    tier: str
    last_use: float = field(default_factory=time.time)

    def to_fields(self) -> dict[str, str]:
        return {k: str(getattr(self, k)) for k in ("length", "token_hash", "nbytes", "tier", "last_use")}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> SessionEntry:
        return cls(
            int(fields["length"]),
            fields["token_hash"],
            int(fields["nbytes"]),
            fields["tier"],
            float(fields["last_use"]),
        )


class SessionIndex(Protocol):
    def get(self, tenant: str, session_id: str) -> SessionEntry | None: ...

    def record(self, tenant: str, session_id: str, entry: SessionEntry) -> None: ...

    def delete(self, tenant: str, session_id: str) -> bool: ...


class MemorySessions:
    """Sessions of one process (offline use and tests)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], SessionEntry] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str, session_id: str) -> SessionEntry | None:
        with self._lock:
            return self._entries.get((tenant, session_id))

    def record(self, tenant: str, session_id: str, entry: SessionEntry) -> None:
        with self._lock:
            self._entries[(tenant, session_id)] = entry

    def delete(self, tenant: str, session_id: str) -> bool:
        with self._lock:
            return self._entries.pop((tenant, session_id), None) is not None


class RedisSessions:
    """Sessions shared by the fleet: ``met:session:{tenant}:{sid}`` hashes with a TTL."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: int = 3600) -> None:
        self.client, self.keys, self.ttl_s = client, keys, ttl_s

    def get(self, tenant: str, session_id: str) -> SessionEntry | None:
        try:
            raw = self.client.hgetall(self.keys.session(tenant, session_id))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        if not raw:
            return None
        fields = {_text(k): _text(v) for k, v in raw.items()}
        try:
            return SessionEntry.from_fields(fields)
        except (KeyError, ValueError):
            return None

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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
