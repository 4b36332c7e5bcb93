"""Batch objects in Redis: ``met:batch:{tenant}:{id}`` (a hash), the tenant's index
``met:batches:{tenant}``, and ``met:batch:{tenant}:{id}:results`` — each finished line, by ``custom_id``,
while the batch runs: its output and error files hold them once it has ended, so the move to a terminal
status deletes them (a batch's answers must not stay in Redis for ever).

Every batch whose status is not terminal is also in the fleet-wide ``met:active-batches`` (as
``{tenant}:{id}``), what ``met top`` reads its batches panel from. That set is not the tenant's (on a
Redis Cluster it lives in another hash slot, ``keys.py``), so it is written in a command of its own:
added to after the batch is stored, taken out of after the move to a terminal status. A writer that
dies in between leaves an ended batch in it, which ``met top`` shows as ended and
``unfinished_reading`` takes out.

Status changes are optimistic transactions (``WATCH`` the hash, check the status, ``MULTI``): the
gateway (cancel) and a runner (everything else) may race, and only moves allowed from the status
actually stored happen. A finished line is written with ``HSETNX``, so a line is kept once even if two
runners finished it.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

from redis.exceptions import WatchError

from metrale.gateway.batches.objects import Batch, BatchError, BatchErrors, BatchStatus, text_of
from metrale.shared.errors import NotFound
from metrale.shared.keys import Keys, check_segment
from metrale.shared.redis_connect import AsyncClient


class BatchStore:
    """The fleet's batch objects, seen by one tenant at a time."""

    def __init__(self, client: AsyncClient, keys: Keys) -> None:
        self._client = client
        self._keys = keys

    async def create(self, tenant: str, batch: Batch) -> None:
        """Store a new batch and index it."""
        created = time.time()
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.batch(tenant, batch.id), mapping=_mapping(batch.to_fields()))
            pipe.zadd(self._keys.batch_index(tenant), {batch.id: created})
            await pipe.execute()
        if not batch.status.is_terminal:
            await self._client.zadd(self._keys.active_batches(), {active_member(tenant, batch.id): created})

    async def get(self, tenant: str, batch_id: str) -> Batch:
        """The batch; raises ``NotFound`` if this tenant has none of that id."""
        fields = await self._client.hgetall(self._key(tenant, batch_id))
        if not fields:
            raise NotFound(f"No such batch: {batch_id!r}.", param="batch_id")
        return Batch.from_fields(fields)

    async def list(self, tenant: str, *, after: str | None, limit: int) -> list[Batch]:
        """The tenant's batches, newest first, after the batch ``after`` (a cursor), at most ``limit``."""
        raw_ids = cast(list[bytes], await self._client.zrevrange(self._keys.batch_index(tenant), 0, -1))
        ids = [text_of(raw) for raw in raw_ids]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        batches = []
        for batch_id in ids[:limit]:
            fields = await self._client.hgetall(self._keys.batch(tenant, batch_id))
            if fields:
                batches.append(Batch.from_fields(fields))
        return batches

    async def move(
        self,
        tenant: str,
        batch_id: str,
        to: BatchStatus,
        *,
        allowed_from: Collection[BatchStatus],
        fields: Mapping[str, str] | None = None,
    ) -> Batch | None:
        """Set the status to ``to`` (and ``{to}_at``, and ``fields``) if it is one of ``allowed_from``;
        the batch as it is after the move, or ``None`` if its status did not allow it."""
        key = self._key(tenant, batch_id)
        async with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    status = await pipe.hget(key, "status")
                    if status is None or BatchStatus(text_of(status)) not in allowed_from:
                        await pipe.unwatch()
                        return None
                    pipe.multi()
                    changes = {"status": to.value, f"{to.value}_at": str(int(time.time())), **(fields or {})}
                    pipe.hset(key, mapping=_mapping(changes))
                    if to.is_terminal:
                        pipe.delete(self._keys.batch_results(tenant, batch_id))
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        if to.is_terminal:
            await self._client.zrem(self._keys.active_batches(), active_member(tenant, batch_id))
        return await self.get(tenant, batch_id)

    async def end_unrun(self, tenant: str, batch_id: str, errors: Sequence[BatchError]) -> BatchStatus | None:
        """Take a batch that can run no further to its end: ``cancelled`` if a cancel asked for it, else
        ``failed`` with ``errors``; the status it is in after (``None`` if it is gone)."""
        failure = {"errors": BatchErrors(data=[*errors]).model_dump_json()}
        for _ in range(2):  # the only move a batch can make between the two is to cancelling
            if await self.move(tenant, batch_id, BatchStatus.CANCELLED, allowed_from={BatchStatus.CANCELLING}):
                return BatchStatus.CANCELLED
            if await self.move(tenant, batch_id, BatchStatus.FAILED, allowed_from=UNFINISHED, fields=failure):
                return BatchStatus.FAILED
        return await self.status(tenant, batch_id)

    async def unfinished_reading(self, tenant: str, file_id: str) -> str | None:
        """The id of an unfinished batch of the tenant whose input is ``file_id``, if there is one. Its
        batches that ended (or are gone) but are still in ``met:active-batches`` are taken out."""
        members = cast(list[bytes], await self._client.zrange(self._keys.active_batches(), 0, -1))
        prefix = f"{check_segment(tenant, 'tenant')}:"
        batch_ids = [member.removeprefix(prefix) for member in map(text_of, members) if member.startswith(prefix)]
        async with self._client.pipeline(transaction=False) as pipe:  # the tenant's keys: one slot
            for batch_id in batch_ids:
                pipe.hmget(self._keys.batch(tenant, batch_id), ["status", "input_file_id"])
            reads = await pipe.execute()
        found, ended = None, []
        for batch_id, (status, input_file_id) in zip(batch_ids, reads, strict=True):
            if status is None or BatchStatus(text_of(status)).is_terminal:
                ended.append(active_member(tenant, batch_id))
            elif found is None and input_file_id is not None and text_of(input_file_id) == file_id:
                found = batch_id
        if ended:
            await self._client.zrem(self._keys.active_batches(), *ended)
        return found

    async def update(self, tenant: str, batch_id: str, fields: Mapping[str, str]) -> None:
        """Set fields that no status change depends on (counts, ``total``)."""
        await self._client.hset(self._key(tenant, batch_id), mapping=_mapping(fields))

    async def status(self, tenant: str, batch_id: str) -> BatchStatus | None:
        """The stored status (``None`` if the batch is gone)."""
        status = await self._client.hget(self._key(tenant, batch_id), "status")
        return BatchStatus(text_of(status)) if status is not None else None

    async def add_result(self, tenant: str, batch_id: str, custom_id: str, line: str, *, ok: bool) -> None:
        """Keep a finished line and count it (once, however often it is written). A line kept after
        the batch ended (a runner that lost its lease finishing late) is dropped again: the move to a
        terminal status deleted the results, and a late line must not bring them back."""
        key, results = self._key(tenant, batch_id), self._keys.batch_results(tenant, batch_id)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hsetnx(results, custom_id, line)
            pipe.hget(key, "status")  # in the same MULTI: a terminal move is wholly before or after it
            kept, status = await pipe.execute()
        if status is None or BatchStatus(text_of(status)).is_terminal:
            await self._client.delete(results)
        elif kept:
            await self._client.hincrby(key, "completed" if ok else "failed", 1)

    async def results(self, tenant: str, batch_id: str) -> dict[str, str]:
        """Every finished line, by ``custom_id``."""
        raw = await self._client.hgetall(self._keys.batch_results(tenant, batch_id))
        return {text_of(name): text_of(value) for name, value in raw.items()}

    def _key(self, tenant: str, batch_id: str) -> str:
        try:
            return self._keys.batch(tenant, check_segment(batch_id, "batch id"))
        except ValueError:
            raise NotFound(f"No such batch: {batch_id!r}.", param="batch_id") from None


UNFINISHED = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING})
"""The statuses a batch can fail from (a cancelling one ends cancelled)."""


def active_member(tenant: str, batch_id: str) -> str:
    """A batch's member in ``met:active-batches``; split it with ``str.partition(":")``."""
    return f"{check_segment(tenant, 'tenant')}:{check_segment(batch_id, 'batch id')}"


def _mapping(fields: Mapping[str, str]) -> dict[Any, Any]:
    """``fields`` as redis-py's ``hset`` types its mapping."""
    return dict(fields)
