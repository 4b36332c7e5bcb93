"""A request's durable record in Redis: what it emitted and how it ended.

Two keys per request (see ``keys.py``): the hash ``met:run:{id}`` holds ``status``, ``worker``,
``finish_reason`` and ``error``, and from its first start ``seed`` and ``cached_tokens``; the list
``met:run:{id}:events`` holds every emitted ``TokenEvent``, encoded by the codec, in the order
written. Both share one TTL, refreshed by every status write and, while events are appended, at
least every ``RECORD_REFRESH_S`` (``refresh_record``). A gateway reads the record to fill a gap in a
client's stream; a worker reads it to resume a request whose worker died, continuing from
``RunRecord.next_seq`` with the recorded ``seed``.

Writers take a pipeline (sync or asyncio; queuing commands is synchronous on both) so that the
caller groups a record update with its other changes, e.g. the final ``append_tokens``, the
``FINISHED`` status and the stream ``XACK`` in one ``MULTI``. While a worker runs a request it is also
in the running index (``record_taken``, ``record_released``). Readers need a client created with
``decode_responses=False`` (the default): events are binary msgpack.

Reading never raises on what Redis holds: a list entry that is not a token event is skipped, and a
hash field that cannot be read (not UTF-8, an unknown status, a seed that is not an integer) reads as
absent; each reason is kept in ``RunRecord.damage`` (and handed to ``on_damage`` with the raw bytes,
for the caller to dead-letter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, TypeAlias, TypeVar, cast

import redis
import redis.asyncio

from metrale.shared.codec import decode, encode
from metrale.shared.keys import DEFAULT_KEYS, Keys
from metrale.shared.messages import FinishReason, GenerateRequest, TokenEvent

logger = logging.getLogger(__name__)

Pipeline: TypeAlias = redis.client.Pipeline | redis.asyncio.client.Pipeline
DamageSink: TypeAlias = Callable[[str, bytes], None]
"""Told each damaged part of a record: the reason and the raw bytes."""

DEFAULT_RECORD_TTL_S = 3600
"""How long a record outlives its last write."""
RUNNING_SEPARATOR = "\x1f"
"""Separates the fields of a ``RunningEntry`` value (ASCII unit separator: in no id or model name)."""
RECORD_REFRESH_S = 60.0
"""Most time between two ``refresh_record`` s of a request whose events are being appended: far below
the TTL, so a running request's record never expires."""


class RunStatus(StrEnum):
    """Where a request is in its life; written to the record hash."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RunRecord:
    """A snapshot of one request's record.

    ``events`` are sorted by ``seq`` with one event per ``seq`` (a repeated write of the same
    ``seq``, e.g. a retried pipeline, is dropped). ``status`` is ``None`` when only events were
    written so far. ``seed`` is the seed the request samples with (None until a worker started it)
    and ``cached_tokens`` the prompt tokens its first worker restored from a checkpoint.
    """

    request_id: str
    status: RunStatus | None
    worker_id: str | None
    finish_reason: FinishReason | None
    error: str | None
    events: tuple[TokenEvent, ...]
    seed: int | None = None
    cached_tokens: int = 0
    damage: tuple[str, ...] = ()
    """Why parts of the record could not be read (they read as absent); empty for a sound record."""

    @property
    def next_seq(self) -> int:
        """The ``seq`` the next event of this request must carry."""
        return self.events[-1].seq + 1 if self.events else 0

    @property
    def is_contiguous(self) -> bool:
        """Whether the events hold every ``seq`` from 0 to ``next_seq - 1``."""
        return all(event.seq == position for position, event in enumerate(self.events))

    def token_ids(self, index: int = 0) -> list[int]:
        """Every token emitted so far for choice ``index``, in order."""
        return [token for event in self.events if event.index == index for token in event.token_ids]

    def is_choice_finished(self, index: int = 0) -> bool:
        """Whether choice ``index`` has sent its final event."""
        return any(event.finished for event in self.events if event.index == index)

    def events_after(self, seq: int) -> list[TokenEvent]:
        """The events with a ``seq`` greater than ``seq``, in order (what a stream that saw ``seq`` lacks)."""
        return [event for event in self.events if event.seq > seq]


def append_tokens(
    pipe: Pipeline, event: TokenEvent, *, keys: Keys = DEFAULT_KEYS, ttl_s: int = DEFAULT_RECORD_TTL_S
) -> None:
    """Queue on ``pipe``: append ``event`` to its request's record, note its worker, refresh the TTL.

    The status is left alone; move it with ``set_status`` (in the same pipeline for the last event).
    """
    append_encoded(pipe, event.request_id, [encode(event)], keys=keys)
    refresh_record(pipe, event.request_id, worker_id=event.worker_id, keys=keys, ttl_s=ttl_s)


def append_encoded(pipe: Pipeline, request_id: str, payloads: Sequence[bytes], *, keys: Keys = DEFAULT_KEYS) -> None:
    """Queue on ``pipe``: append already encoded events (one request's, in ``seq`` order) to its record.

    Neither the worker nor the TTL is touched: a writer that appends on every step refreshes them with
    ``refresh_record`` when a request's first events go out and then often enough for the TTL.
    """
    pipe.rpush(keys.run_events(request_id), *payloads)


def refresh_record(
    pipe: Pipeline, request_id: str, *, worker_id: str, keys: Keys = DEFAULT_KEYS, ttl_s: int = DEFAULT_RECORD_TTL_S
) -> None:
    """Queue on ``pipe``: note the worker writing the request's events, refresh the TTL of both keys."""
    pipe.hset(keys.run_record(request_id), "worker", worker_id)
    _refresh_ttl(pipe, request_id, keys, ttl_s)


def record_start(
    pipe: Pipeline,
    request_id: str,
    *,
    seed: int,
    cached_tokens: int,
    keys: Keys = DEFAULT_KEYS,
    ttl_s: int = DEFAULT_RECORD_TTL_S,
) -> None:
    """Queue on ``pipe``: what a later worker needs to continue the request exactly, refresh the TTL.

    Written before any of the request's events, so a record with events always names its ``seed``.
    """
    pipe.hset(keys.run_record(request_id), mapping={"seed": str(seed), "cached_tokens": str(cached_tokens)})
    _refresh_ttl(pipe, request_id, keys, ttl_s)


def set_status(
    pipe: Pipeline,
    request_id: str,
    status: RunStatus,
    *,
    worker_id: str | None = None,
    finish_reason: FinishReason | None = None,
    error: str | None = None,
    keys: Keys = DEFAULT_KEYS,
    ttl_s: int = DEFAULT_RECORD_TTL_S,
) -> None:
    """Queue on ``pipe``: set a request's status (and worker), refresh the TTL.

    ``FINISHED`` requires a ``finish_reason``; other statuses clear any earlier one. ``error`` goes
    with ``FinishReason.ERROR`` or ``REFUSED`` only.
    """
    if (status is RunStatus.FINISHED) != (finish_reason is not None):
        raise ValueError("finish_reason is given exactly when the status is FINISHED")
    if error is not None and (finish_reason is None or not finish_reason.is_error):
        raise ValueError("an error message requires finish_reason ERROR or REFUSED")
    record_key = keys.run_record(request_id)
    outcome = {"finish_reason": finish_reason, "error": error}  # removed from the hash when absent
    fields = {"status": status.value, "worker": worker_id} | outcome
    pipe.hset(record_key, mapping={name: str(value) for name, value in fields.items() if value is not None})
    cleared = [name for name, value in outcome.items() if value is None]
    if cleared:
        pipe.hdel(record_key, *cleared)
    _refresh_ttl(pipe, request_id, keys, ttl_s)


@dataclass(frozen=True, slots=True)
class RunningEntry:
    """What the running index says of a request a worker runs (``met top``'s requests panel)."""

    request_id: str
    model: str
    tenant: str
    priority: str
    worker_id: str
    created_at: float
    taken_at: float

    def encode(self) -> str:
        """The value in ``met:running:info``: the fields joined by ``RUNNING_SEPARATOR`` (split far
        faster than a codec message or JSON is parsed, which matters with thousands in flight)."""
        texts = (self.model, self.tenant, self.priority, self.worker_id)
        clean = (text.replace(RUNNING_SEPARATOR, " ") for text in texts)
        return RUNNING_SEPARATOR.join((*clean, repr(self.created_at), repr(self.taken_at)))

    @classmethod
    def parse(cls, request_id: str, raw: bytes | str | None) -> RunningEntry | None:
        """The entry from its ``met:running:info`` value; None when absent or malformed."""
        fields = cls.fields(raw)
        return cls(request_id, *fields) if fields is not None else None

    @staticmethod
    def fields(raw: bytes | str | None) -> tuple[str, str, str, str, float, float] | None:
        """``(model, tenant, priority, worker_id, created_at, taken_at)`` of a ``met:running:info``
        value, without building the entry (for a reader of thousands); None when absent or malformed."""
        if raw is None:
            return None
        parts = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw).split(RUNNING_SEPARATOR)
        if len(parts) != 6:
            return None
        try:
            created_at, taken_at = float(parts[4]), float(parts[5])
        except ValueError:
            return None
        return parts[0], parts[1], parts[2], parts[3], created_at, taken_at


def record_taken(
    pipe: Pipeline,
    request: GenerateRequest,
    *,
    worker_id: str,
    taken_at: float,
    keys: Keys = DEFAULT_KEYS,
    ttl_s: int = DEFAULT_RECORD_TTL_S,
) -> None:
    """Queue on ``pipe``: a worker took ``request``: its status ``RUNNING`` there, and its entry in the
    running index of its shard (``met:running`` by when it was taken, ``met:running:info`` what an
    operator's view shows of it; one of each per shard on a Redis Cluster). Undone by
    ``record_released`` in the pipeline that finishes it or hands it back."""
    set_status(pipe, request.request_id, RunStatus.RUNNING, worker_id=worker_id, keys=keys, ttl_s=ttl_s)
    entry = RunningEntry(
        request.request_id,
        request.model,
        request.tenant,
        request.priority.value,
        worker_id,
        request.created_at,
        taken_at,
    )
    shard = keys.shard_of(request.request_id)
    pipe.zadd(keys.running_index(shard), {request.request_id: taken_at})
    pipe.hset(keys.running_info(shard), request.request_id, entry.encode())


def record_released(pipe: Pipeline, request_id: str, *, keys: Keys = DEFAULT_KEYS) -> None:
    """Queue on ``pipe``: ``request_id`` no longer runs on a worker (finished, or handed back)."""
    shard = keys.shard_of(request_id)
    pipe.zrem(keys.running_index(shard), request_id)
    pipe.hdel(keys.running_info(shard), request_id)


def queue_record_read(pipe: Pipeline, request_id: str, *, keys: Keys = DEFAULT_KEYS) -> None:
    """Queue on ``pipe`` the two reads (hash, then events) that ``parse_record`` turns into a record."""
    pipe.hgetall(keys.run_record(request_id))
    pipe.lrange(keys.run_events(request_id), 0, -1)


def read_record(client: redis.Redis, request_id: str, *, keys: Keys = DEFAULT_KEYS) -> RunRecord | None:
    """Read one request's record atomically; ``None`` if it never existed or has expired."""
    with client.pipeline(transaction=True) as pipe:
        queue_record_read(pipe, request_id, keys=keys)
        fields, raw_events = pipe.execute()
    return parse_record(request_id, fields, raw_events)


async def read_record_async(
    client: redis.asyncio.Redis, request_id: str, *, keys: Keys = DEFAULT_KEYS, on_damage: DamageSink | None = None
) -> RunRecord | None:
    """The asyncio twin of ``read_record``."""
    async with client.pipeline(transaction=True) as pipe:
        queue_record_read(pipe, request_id, keys=keys)
        fields, raw_events = await pipe.execute()
    return parse_record(request_id, fields, raw_events, on_damage=on_damage)


async def read_events_from_async(
    client: redis.asyncio.Redis,
    request_id: str,
    next_seq: int,
    *,
    keys: Keys = DEFAULT_KEYS,
    on_damage: DamageSink | None = None,
) -> tuple[TokenEvent, ...] | None:
    """The events of ``request_id``'s record a reader that has every ``seq`` below ``next_seq`` may lack
    (sorted by ``seq``, one per ``seq``, possibly with some it has), or ``None`` when there is no record.

    Workers append each ``seq`` first after every smaller one, so a list whose entry at index
    ``next_seq - 1`` holds that very ``seq`` holds every later ``seq`` after that index: only that
    tail is read and decoded. A list that departs from this (one that lost its start to a Redis
    restarted empty) is read whole, as ``read_record_async`` does. Damaged parts go to ``on_damage``.
    """
    anchor = next_seq - 1
    if anchor >= 0:
        raw_tail = cast(list[bytes], await client.lrange(keys.run_events(request_id), anchor, -1))
        if raw_tail:
            first = decode(raw_tail[0])
            if isinstance(first, TokenEvent) and first.seq == anchor:
                return _ordered_events(request_id, raw_tail[1:], on_damage)
    record = await read_record_async(client, request_id, keys=keys, on_damage=on_damage)
    return record.events if record is not None else None


def _refresh_ttl(pipe: Pipeline, request_id: str, keys: Keys, ttl_s: int) -> None:
    pipe.expire(keys.run_record(request_id), ttl_s)
    pipe.expire(keys.run_events(request_id), ttl_s)


def parse_record(
    request_id: str,
    fields: Mapping[Any, Any],
    raw_events: Sequence[bytes],
    *,
    on_damage: DamageSink | None = None,
) -> RunRecord | None:
    """The record from the replies of ``queue_record_read``; ``None`` if it does not exist. Never raises:
    damaged parts read as absent and are listed in ``damage``."""
    if not fields and not raw_events:
        return None
    damage: list[str] = []

    def damaged(reason: str, raw: bytes) -> None:
        damage.append(reason)
        logger.warning("run record %s: %s", request_id, reason)
        if on_damage is not None:
            on_damage(reason, raw)

    text: dict[str, str] = {}
    for name, value in fields.items():
        try:
            text[_text(name)] = _text(value)
        except UnicodeDecodeError:
            damaged(f"hash field {name!r} is not UTF-8", _raw(name) + b"=" + _raw(value))
    status = _parsed(text, "status", RunStatus, damaged)
    finish_reason = _parsed(text, "finish_reason", FinishReason, damaged)
    seed = _parsed(text, "seed", int, damaged)
    cached_tokens = _parsed(text, "cached_tokens", int, damaged)
    events = _ordered_events(request_id, raw_events, damaged)
    return RunRecord(
        request_id=request_id,
        status=status,
        worker_id=text.get("worker"),
        finish_reason=finish_reason,
        error=text.get("error"),
        events=events,
        seed=seed,
        cached_tokens=cached_tokens if cached_tokens is not None and cached_tokens >= 0 else 0,
        damage=tuple(damage),
    )


Parsed = TypeVar("Parsed")


def _parsed(text: Mapping[str, str], name: str, parse: Callable[[str], Parsed], damaged: DamageSink) -> Parsed | None:
    """``text[name]`` parsed, or None when absent or unreadable (reported to ``damaged``)."""
    value = text.get(name)
    if value is None:
        return None
    try:
        return parse(value)
    except ValueError:
        damaged(f"hash field {name!r} holds {value[:40]!r}", value.encode())
        return None


def _ordered_events(
    request_id: str, raw_events: Sequence[bytes], damaged: DamageSink | None = None
) -> tuple[TokenEvent, ...]:
    by_seq: dict[int, TokenEvent] = {}
    for raw in raw_events:
        event = decode(raw) if isinstance(raw, bytes) else decode(_raw(raw))
        if not isinstance(event, TokenEvent):
            reason = f"an entry that is not a token event: {event}"
            if damaged is not None:
                damaged(reason, _raw(raw))
            else:
                logger.warning("run record %s holds %s", request_id, reason)
            continue
        kept = by_seq.setdefault(event.seq, event)
        # The same event from two workers (a lapsed worker's last step beside its heir's first) is no damage.
        if kept is not event and replace(event, worker_id=kept.worker_id) != kept:
            logger.warning("run record %s holds two different events with seq %d", request_id, event.seq)
    return tuple(by_seq[seq] for seq in sorted(by_seq))


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode(errors="replace")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
