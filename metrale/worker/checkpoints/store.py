"""Where checkpoint bytes live: a host-memory LRU, Redis (shared by the fleet), optionally a directory.

Tiers are tried fastest first; a hit in a slower tier is copied into the first tier. Writes go to every
tier (callers keep them off the engine's step loop). Losing any tier only costs speed: a tier that fails
reads as unavailable, never as a wrong answer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import redis

log = logging.getLogger(__name__)


class StoreUnavailable(Exception):
    """A tier could not be read or written (connection lost, disk error)."""


class Tier(Protocol):
    name: str

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...

    def delete(self, key: str) -> None: ...


class MemoryTier:
    """An LRU of checkpoint bytes bounded by total size and entry count."""

    name = "memory"

    def __init__(self, max_bytes: int = 256 << 20, max_entries: int = 4096) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        with self._lock:
            self._drop(key)
            self._items[key] = data
            self._bytes += len(data)
            while self._bytes > self.max_bytes or len(self._items) > self.max_entries:
                self._drop(next(iter(self._items)))

    def delete(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def _drop(self, key: str) -> None:
        data = self._items.pop(key, None)
        if data is not None:
            self._bytes -= len(data)


class RedisTier:
    """Checkpoints as Redis strings with a TTL, readable by every worker of the fleet."""

    name = "redis"

    def __init__(self, client: redis.Redis, ttl_s: int = 3600, max_bytes: int = 64 << 20) -> None:
        self.client, self.ttl_s, self.max_bytes = client, ttl_s, max_bytes

    def get(self, key: str) -> bytes | None:
        try:
            data = self.client.get(key)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        return data if isinstance(data, bytes) else None

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        try:
            self.client.set(key, data, ex=self.ttl_s)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    def delete(self, key: str) -> None:
        try:
            self.client.delete(key)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc


class DirectoryTier:
    """One file per checkpoint under a directory (for states too large for Redis)."""

    name = "directory"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.ckpt"

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"directory: {exc}") from exc

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        staging = path.with_suffix(f".tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            staging.write_bytes(data)
            staging.replace(path)
        except OSError as exc:
            raise StoreUnavailable(f"directory: {exc}") from exc

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class Found:
    data: bytes
    tier: str


class TieredStore:
    """Reads the fastest tier first; writes every tier, logging (not raising) a tier that fails."""

    def __init__(self, tiers: list[Tier]) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = tiers

    def get(self, key: str) -> Found | None:
        """The bytes under ``key`` and the tier that had them; raises ``StoreUnavailable`` only when no
        tier had them and at least one failed."""
        failure: StoreUnavailable | None = None
        for i, tier in enumerate(self.tiers):
            try:
                data = tier.get(key)
            except StoreUnavailable as exc:
                failure = exc
                continue
            if data is not None:
                if i > 0:
                    self.tiers[0].put(key, data)
                return Found(data, tier.name)
        if failure is not None:
            raise failure
        return None

    def put(self, key: str, data: bytes) -> str:
        """Write every tier; return the slowest tier that took it."""
        stored = ""
        for tier in self.tiers:
            try:
                tier.put(key, data)
                stored = tier.name
            except StoreUnavailable as exc:
                log.warning("checkpoint %s not written to %s: %s", key, tier.name, exc)
        return stored

    def delete(self, key: str) -> None:
        for tier in self.tiers:
            try:
                tier.delete(key)
            except StoreUnavailable as exc:
                log.warning("could not delete checkpoint %s: %s", key, exc)
