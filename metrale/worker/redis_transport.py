"""The fleet protocol's worker side over Redis (sync redis-py): streams in, pub/sub and records out.

Requests are read with ``XREADGROUP`` (group ``WORKER_GROUP``, consumer = the worker id), the
interactive stream before the batch stream. Each ``publish`` is one ``MULTI`` pipeline: every
``PUBLISH`` of a token event with its record append, then for each finished request its
``FINISHED`` status, ``XACK`` and ``XDEL``. Redis commands retry with capped exponential backoff;
once those retries are spent, a ``TransportError`` tells the worker loop to back off and call again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeAlias, cast

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from metrale.shared.codec import decode, encode
from metrale.shared.keys import DEFAULT_KEYS, WORKER_GROUP, Keys
from metrale.shared.messages import (
    CancelRequest,
    GenerateRequest,
    ModelAnnouncement,
    Priority,
    TokenEvent,
    WorkerHeartbeat,
)
from metrale.shared.record import RunStatus, append_tokens, set_status
from metrale.worker.transport import (
    DUPLICATE_REASON,
    DeadLetter,
    FinishedRequest,
    Received,
    TransportError,
    parse_entry,
)

logger = logging.getLogger(__name__)

COMMAND_RETRIES = 5
"""Retries of one Redis command on a connection error before ``TransportError`` is raised."""
RETRY_BACKOFF_CAP_S = 2.0
RETRY_BACKOFF_BASE_S = 0.05
SOCKET_TIMEOUT_S = 10.0
"""Longer than any blocking read the worker makes (at most a few tens of milliseconds)."""

_MSG = "msg"

_StreamReply: TypeAlias = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]
"""``XREADGROUP``'s reply (RESP2): per stream, its entries as ``(entry id, fields)``."""
_Taken: TypeAlias = tuple[str, str, dict[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where a taken request sits in its stream, to acknowledge it once finished."""

    stream: str
    entry_id: str


def redis_client(url: str) -> redis.Redis:
    """A binary-safe client of ``url`` that retries commands with capped exponential backoff."""
    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=RETRY_BACKOFF_CAP_S, base=RETRY_BACKOFF_BASE_S), COMMAND_RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
        health_check_interval=30,
    )


class RedisTransport:
    """A ``WorkerTransport`` over one Redis client (``decode_responses=False``) and its pub/sub.

    Nothing touches Redis until the first call, so a worker can start while Redis is down. The
    consumer groups and the cancel subscription are (re)made on first use and after every connection
    error, so a restarted, empty Redis is picked up again.
    """

    def __init__(
        self, client: redis.Redis, *, worker_id: str, keys: Keys = DEFAULT_KEYS, heartbeat_ttl_s: int = 10
    ) -> None:
        self._client = client
        self._worker_id = worker_id
        self._keys = keys
        self._heartbeat_ttl_s = heartbeat_ttl_s
        self._pubsub = client.pubsub()
        self._entries: dict[str, _Entry] = {}
        self._prepared = False

    def receive(self, max_new: int, block_ms: int) -> list[Received]:
        if max_new <= 0:
            return []
        with self._unavailable_as_transport_error():
            self._prepare()
            entries = self._read(Priority.INTERACTIVE, max_new)
            if len(entries) < max_new:
                entries += self._read(Priority.BATCH, max_new - len(entries))
            if not entries and block_ms > 0:  # batch entries that arrive meanwhile wait one more call
                entries = self._read(Priority.INTERACTIVE, max_new, block_ms)
            return self._accept(entries)

    def cancellations(self) -> list[str]:
        with self._unavailable_as_transport_error():
            self._prepare()
            cancelled = []
            while (message := self._pubsub.get_message(timeout=0.0)) is not None:
                if message["type"] != "message":  # (un)subscribe confirmations
                    continue
                cancel = decode(message["data"])
                if isinstance(cancel, CancelRequest):
                    cancelled.append(cancel.request_id)
                else:
                    logger.warning("ignoring a cancellation that is not a cancel message: %s", cancel)
            return cancelled

    def publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> None:
        if not events and not finished:
            return
        with self._unavailable_as_transport_error(), self._client.pipeline(transaction=True) as pipe:
            for event in events:
                pipe.publish(self._keys.token_channel(event.request_id), encode(event))
                append_tokens(pipe, event, keys=self._keys)
            for done in finished:
                self._queue_finish(pipe, done)
            pipe.execute()
        for done in finished:  # forgotten only once written: a failed publish is repeated as is
            self._entries.pop(done.request_id, None)

    def heartbeat(self, stats: WorkerHeartbeat) -> None:
        key = self._keys.worker(stats.worker_id)
        with self._unavailable_as_transport_error(), self._client.pipeline(transaction=True) as pipe:
            pipe.hset(key, _MSG, encode(stats))
            pipe.expire(key, self._heartbeat_ttl_s)
            pipe.execute()

    def announce(self, model: ModelAnnouncement) -> None:
        with self._unavailable_as_transport_error():
            self._client.hset(self._keys.model(model.model), _MSG, encode(model))

    def close(self) -> None:
        try:
            with self._unavailable_as_transport_error():
                self._client.delete(self._keys.worker(self._worker_id))
        finally:
            self._pubsub.close()
            self._client.close()

    def _prepare(self) -> None:
        if self._prepared:
            return
        for priority in Priority:
            try:
                self._client.xgroup_create(self._keys.request_stream(priority), WORKER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._pubsub.subscribe(self._keys.cancel_channel())
        self._prepared = True

    def _read(self, priority: Priority, count: int, block_ms: int | None = None) -> list[_Taken]:
        """Up to ``count`` new entries of one stream as ``(stream, entry id, fields)``."""
        stream = self._keys.request_stream(priority)
        try:
            reply = cast(
                _StreamReply | None,
                self._client.xreadgroup(WORKER_GROUP, self._worker_id, {stream: ">"}, count=count, block=block_ms),
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            logger.warning("the consumer group on %s is gone (Redis restarted?); recreating it", stream)
            self._prepared = False
            return []
        return [(stream, _text(entry_id), fields) for _, entries in reply or [] for entry_id, fields in entries]

    def _accept(self, entries: list[_Taken]) -> list[Received]:
        """Keep servable requests (marked running), set every other entry aside, in one pipeline."""
        received: list[Received] = []
        with self._client.pipeline(transaction=True) as pipe:
            for stream, entry_id, fields in entries:
                raw = fields.get(_MSG.encode())
                parsed = parse_entry(raw)
                if isinstance(parsed, GenerateRequest) and parsed.request_id in self._entries:
                    parsed = DUPLICATE_REASON
                if isinstance(parsed, GenerateRequest):
                    self._entries[parsed.request_id] = _Entry(stream, entry_id)
                    set_status(pipe, parsed.request_id, RunStatus.RUNNING, worker_id=self._worker_id, keys=self._keys)
                    received.append(parsed)
                else:
                    dead = DeadLetter(stream, entry_id, parsed, raw or b"")
                    self._queue_dead_letter(pipe, dead)
                    received.append(dead)
            if entries:
                pipe.execute()
        return received

    def _queue_dead_letter(self, pipe: redis.client.Pipeline, dead: DeadLetter) -> None:
        fields = {"reason": dead.reason, "stream": dead.stream, "entry_id": dead.entry_id, "raw": dead.raw}
        pipe.xadd(self._keys.dead_letter(), fields)  # type: ignore[arg-type]  # redis-py's stub wants str values
        pipe.xack(dead.stream, WORKER_GROUP, dead.entry_id)
        pipe.xdel(dead.stream, dead.entry_id)

    def _queue_finish(self, pipe: redis.client.Pipeline, done: FinishedRequest) -> None:
        set_status(
            pipe,
            done.request_id,
            RunStatus.FINISHED,
            worker_id=self._worker_id,
            finish_reason=done.finish_reason,
            error=done.error,
            keys=self._keys,
        )
        entry = self._entries.get(done.request_id)
        if entry is not None:
            pipe.xack(entry.stream, WORKER_GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)

    @contextmanager
    def _unavailable_as_transport_error(self) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._prepared = False
            raise TransportError(f"Redis is unreachable: {exc}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
