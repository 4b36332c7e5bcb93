"""Background responses in Redis: their status, their object as it grows, and their numbered events.

A background response lives in the stored response's hash (``met:resp:{tenant}:{id}``, ``store.py``)
with a few more fields: ``background`` ("1"), ``status``, ``request`` (the create body, which the
batch runner's job prepares again), ``created_at``, ``deadline``, ``next_seq`` (the next event's
``sequence_number``) and ``read_chars`` (how much of the model's text the stored events cover, which
a job run again after its runner died skips). Its events are a stream,
``met:resp:{tenant}:{id}:events``, event ``n`` at entry id ``n-1``, so reading after ``n`` is
``XREAD`` after ``n-1``. Both expire with the response's TTL.

Status moves ``queued`` → ``in_progress`` → ``completed`` / ``incomplete`` / ``failed``, or to
``cancelled`` from either of the first two; a terminal status never changes. Invariant: events are
appended only in the same transaction that finds the status it expects (``queued`` for the opening
events, ``in_progress`` for the rest), and a terminal move appends its last events with it; so once a
reader sees a terminal status, every event there will ever be is in the stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline
from redis.exceptions import WatchError

from metrale.gateway.responses.output import OutputEvent
from metrale.gateway.responses.store import StoredResponse, stored_fields
from metrale.shared.keys import Keys
from metrale.shared.redis_connect import AsyncClient


class BackgroundStatus(StrEnum):
    """A background response's ``status``, as the Responses API names it."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self not in (BackgroundStatus.QUEUED, BackgroundStatus.IN_PROGRESS)


UNFINISHED = frozenset({BackgroundStatus.QUEUED, BackgroundStatus.IN_PROGRESS})

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
"""Event types after which a response's stream has nothing more."""


@dataclass(frozen=True, slots=True)
class BackgroundJob:
    """What a job needs to (re)run a background response."""

    status: BackgroundStatus
    request_json: str
    created_at: float
    deadline: float
    read_chars: int


class BackgroundStore:
    """Background responses of every tenant (another tenant's id reads as missing)."""

    def __init__(self, client: AsyncClient, keys: Keys, ttl_s: int) -> None:
        self.client, self.keys, self.ttl_s = client, keys, ttl_s

    async def create(
        self,
        tenant: str,
        body: dict[str, Any],
        *,
        request_json: str,
        created_at: float,
        deadline: float,
        events: Sequence[OutputEvent],
    ) -> None:
        """Keep a new ``queued`` response (``body``) and its opening ``events`` (numbered from 0)."""
        response_id = body["id"]
        key = self.keys.response(tenant, response_id)
        fields = {
            "stored": "1",
            "background": "1",
            "status": BackgroundStatus.QUEUED.value,
            "object": json.dumps(body),
            "request": request_json,
            "created_at": repr(created_at),
            "deadline": repr(deadline),
            "next_seq": "0",
            "read_chars": "0",
        }
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key, self.keys.response_events(tenant, response_id))
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            self._append(pipe, tenant, response_id, 0, events)
            pipe.expire(key, self.ttl_s)
            pipe.zadd(self.keys.response_index(tenant), {response_id: time.time() + self.ttl_s})
            await pipe.execute()

    async def job(self, tenant: str, response_id: str) -> BackgroundJob | None:
        """The response's job record; None if it is gone (deleted, expired) or not a background one."""
        raw = await self.client.hmget(
            self.keys.response(tenant, response_id),
            ["background", "status", "request", "created_at", "deadline", "read_chars"],
        )
        background, status, request, created_at, deadline, read_chars = (_text(value) for value in raw)
        if background != "1" or status is None or request is None:
            return None
        return BackgroundJob(
            BackgroundStatus(status), request, float(created_at or 0), float(deadline or 0), int(read_chars or 0)
        )

    async def status(self, tenant: str, response_id: str) -> BackgroundStatus | None:
        value = _text(await self.client.hget(self.keys.response(tenant, response_id), "status"))
        return BackgroundStatus(value) if value is not None else None

    async def start(self, tenant: str, response_id: str, body: dict[str, Any], event: OutputEvent) -> bool:
        """``queued`` → ``in_progress`` with ``body`` as its object and ``event``; False if it was not queued."""
        queued, fields = {BackgroundStatus.QUEUED}, {"object": json.dumps(body)}
        return await self._move(tenant, response_id, queued, BackgroundStatus.IN_PROGRESS, [event], fields)

    async def append(
        self,
        tenant: str,
        response_id: str,
        events: Sequence[OutputEvent],
        *,
        read_chars: int,
        body: dict[str, Any] | None = None,
    ) -> bool:
        """Append ``events`` of a response in progress, covering its text up to ``read_chars`` (and keep
        ``body`` as its object when given); False, appending nothing, if it is no longer in progress."""
        fields = {"read_chars": str(read_chars)}
        if body is not None:
            fields["object"] = json.dumps(body)
        status = BackgroundStatus.IN_PROGRESS
        return await self._move(tenant, response_id, {status}, status, events, fields)

    async def finish(self, tenant: str, stored: StoredResponse, events: Sequence[OutputEvent]) -> bool:
        """End a response in progress as ``stored`` (its object's status: ``completed`` or
        ``incomplete``), kept for ``retrieve`` and continuation like a foreground one, with its last
        ``events``; False if it had ended already (cancelled)."""
        body = stored.body
        to, running = BackgroundStatus(body["status"]), {BackgroundStatus.IN_PROGRESS}
        return await self._move(tenant, body["id"], running, to, events, stored_fields(stored))

    async def fail(self, tenant: str, response_id: str, code: str, message: str) -> bool:
        """End an unfinished response as ``failed`` with ``error``; False if it had ended already."""

        def failed(body: dict[str, Any]) -> list[OutputEvent]:
            body.update(status=BackgroundStatus.FAILED.value, error={"code": code, "message": message})
            return [OutputEvent("response.failed", {"response": body})]

        return await self._end(tenant, response_id, BackgroundStatus.FAILED, failed)

    async def cancel(self, tenant: str, response_id: str) -> bool:
        """End an unfinished response as ``cancelled`` (no event: the Responses stream has no
        cancelled event; a reader ends on the status); False if it had ended already."""

        def cancelled(body: dict[str, Any]) -> list[OutputEvent]:
            body["status"] = BackgroundStatus.CANCELLED.value
            return []

        return await self._end(tenant, response_id, BackgroundStatus.CANCELLED, cancelled)

    async def read(self, tenant: str, response_id: str, after: int, *, block_ms: int | None) -> list[str]:
        """The events' JSON after ``sequence_number`` ``after`` (-1: from the first), waiting up to
        ``block_ms`` for one when there are none yet (None: no wait)."""
        key = self.keys.response_events(tenant, response_id)
        found: Any = await self.client.xread({key: _entry_id(after)}, count=512, block=block_ms)
        if not found:
            return []
        # RESP2 answers [[key, entries]], RESP3 {key: entries}
        entries = next(iter(found.values())) if isinstance(found, dict) else found[0][1]
        return [_text(fields[b"event"]) or "" for _, fields in entries]

    async def _end(
        self,
        tenant: str,
        response_id: str,
        to: BackgroundStatus,
        change: Callable[[dict[str, Any]], list[OutputEvent]],
    ) -> bool:
        """Move an unfinished response to ``to``: ``change`` edits its object and gives the events."""
        key = self.keys.response(tenant, response_id)
        raw = _text(await self.client.hget(key, "object"))
        if raw is None:
            return False
        body = json.loads(raw)
        events = change(body)
        return await self._move(tenant, response_id, UNFINISHED, to, events, {"object": json.dumps(body)})

    async def _move(
        self,
        tenant: str,
        response_id: str,
        allowed_from: Set[BackgroundStatus],
        to: BackgroundStatus,
        events: Sequence[OutputEvent],
        fields: Mapping[str, str] | Mapping[str, bytes],
    ) -> bool:
        """If the status is one of ``allowed_from``: set it to ``to`` with ``fields`` and append
        ``events``, in one transaction. Whether it did."""
        key = self.keys.response(tenant, response_id)
        async with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    status, next_seq = (_text(value) for value in await pipe.hmget(key, ["status", "next_seq"]))
                    if status is None or BackgroundStatus(status) not in allowed_from:
                        await pipe.unwatch()
                        return False
                    pipe.multi()
                    changes: dict[Any, Any] = {**fields, "status": to.value}
                    pipe.hset(key, mapping=changes)
                    self._append(pipe, tenant, response_id, int(next_seq or 0), events)
                    await pipe.execute()
                    return True
                except WatchError:
                    continue

    def _append(
        self, pipe: Pipeline | ClusterPipeline, tenant: str, response_id: str, first: int, events: Sequence[OutputEvent]
    ) -> None:
        """Number ``events`` from ``first`` and add them to the stream, in ``pipe``."""
        events_key = self.keys.response_events(tenant, response_id)
        for seq, event in enumerate(events, start=first):
            data = json.dumps({"type": event.kind, "sequence_number": seq, **event.fields}, ensure_ascii=False)
            pipe.xadd(events_key, {"event": data}, id=_entry_id(seq))
        if events:
            pipe.hset(self.keys.response(tenant, response_id), "next_seq", str(first + len(events)))
        pipe.expire(events_key, self.ttl_s)


def _entry_id(seq: int) -> str:
    """The stream entry id of event ``seq`` (``-1``: before the first): ``{seq}-1``, always above ``0-0``."""
    return f"{seq}-1" if seq >= 0 else "0-0"


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
