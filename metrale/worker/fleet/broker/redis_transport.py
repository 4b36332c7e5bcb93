"""The fleet protocol's worker side over Redis (sync redis-py): streams in, pub/sub and records out.

Requests are taken by ``XREADGROUP`` (group ``WORKER_GROUP``, consumer = the worker id), the
interactive stream before the batch stream, after the requests of lost workers (``reclaim.py``).
Taking an entry reads the request's record and marks it running (and in the running index), in
one ``MULTI``; finishing or handing it back takes it out of the index in the same ``MULTI``. ``begin`` writes a
started request's seed to its record; should Redis restart empty, the announcement and the records
of the requests in flight here are written again. Each ``publish`` is one ``MULTI`` transaction, packed
by hand (``resp.py``; its channels and record keys packed once per request): the step's token events
(only the first and the final ones of a request without ``live_events``) published once per reply
channel, a ``TokenEventGroup`` of every request naming that relay in ``reply_to`` (a request without
one: a ``PUBLISH`` per event on its own token channel), and one record append per request (the
record's worker and TTL refreshed with a request's first events here, then every
``RECORD_REFRESH_S``), then for each finished request its ``FINISHED`` status,
``XACK`` and ``XDEL`` (and a dead-letter entry for a poison request), done only while this worker
still owns the entry (``owned_entries.py``: a lapsed worker never lets go of its heir's entry).
``hand_back`` re-queues a request as a new entry and drops the old one, atomically (likewise only
while it owns the old one). Redis commands retry with capped
exponential backoff; once those retries are spent, a ``TransportError`` tells the worker loop to
back off and call again. With replicas to wait for (``replication``, ``MET_REDIS_WAIT_REPLICAS``), a take,
a ``begin`` and a ``publish`` are each confirmed with ``WAIT`` and, when the primary that answers after a
failover lacks them, written again (``shared/replication.py``); the very entry a worker holds, delivered
again by a promoted replica that never heard of the take, is ignored. The pub/sub connection that
hears cancellations also hears the orders sent to this worker on its control channel (``controls``).

On a Redis Cluster (``redis+cluster://``; ``Keys.shards`` > 1) every transaction stays in one hash slot:
a worker takes from every shard's stream of a priority before the next priority (``shard_intake.py``,
the first shard rotating per call; an idle worker polls them every ``CLUSTER_IDLE_POLL_S`` instead of
blocking on one), and a take, ``begin``, ``publish`` and ``hand_back`` write one ``MULTI`` per shard of
the requests they touch. A step's transactions go each to its shard's primary (``SlotRouter``, following
``MOVED`` and a replica's promotion), and only after they are written is each reply channel's group sent
with ``SPUBLISH`` (sharded pub/sub: to the shard of the channel's slot), so a relay that reads a record
after hearing a group finds the group's events there. A shard's transaction cut off by a lost primary may
or may not have run: it is written again only when the shard's primary lacks it (``_lacks``), so a
failover writes no event twice. Cancellations and orders arrive by ``SSUBSCRIBE``. The control keys
(heartbeats, announcements) are written without ``MULTI`` there. ``WAIT`` for replicas is refused.

A worker calls its transport from its loop's thread. ``start_publish`` sends a step's transaction on a
pooled connection it holds until the replies are read (after the next step); every other Redis call
takes a connection of its own from the pool. The maps of requests in flight here are read and changed
only under ``_books``, so a transport may also be shared with other threads.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar, cast

import redis
import redis.cluster
from redis.exceptions import ClusterDownError, MovedError, RedisClusterException, TryAgainError

from metrale.shared.codec import decode, encode
from metrale.shared.heartbeats import queue_heartbeat, queue_withdrawal
from metrale.shared.keys import DEFAULT_KEYS, WORKER_GROUP, Keys
from metrale.shared.messages import (
    CancelRequest,
    GenerateRequest,
    ModelAnnouncement,
    Priority,
    TokenEvent,
    TokenEventGroup,
    WorkerControl,
    WorkerHeartbeat,
)
from metrale.shared.record import (
    RECORD_REFRESH_S,
    RunStatus,
    parse_record,
    queue_record_read,
    record_released,
    record_start,
    record_taken,
    refresh_record,
    set_status,
)
from metrale.shared.redis_connect import BACKOFF_BASE_S, BACKOFF_CAP_S, SyncClient, connect_sync
from metrale.shared.replication import NO_WAIT, Replication, ReplicaWaiter
from metrale.worker.fleet.broker.cluster_router import FAILOVER_RETRIES, SlotRouter
from metrale.worker.fleet.broker.owned_entries import queue_release
from metrale.worker.fleet.broker.reclaim import Reclaimer, TakenEntry
from metrale.worker.fleet.broker.resp import (
    SentBatch,
    SentTransaction,
    Transaction,
    bulk,
    execute_transaction,
    send_transaction,
    send_transactions,
)
from metrale.worker.fleet.broker.shard_intake import node_reads, take_from_shards
from metrale.worker.fleet.transport import (
    DUPLICATE_REASON,
    DeadLetter,
    FinishedRequest,
    Received,
    Redelivery,
    StartedRequest,
    TransportError,
    parse_entry,
    ran_before,
    receive_limits,
)

logger = logging.getLogger(__name__)

COMMAND_RETRIES = 5
"""Retries of one Redis command on a connection error before ``TransportError`` is raised."""
BUSY_POLL_S = 0.010
"""How often a worker (``poll_every_s``) looks for new requests and cancellations when its steps are
faster than that."""
SOCKET_TIMEOUT_S = 10.0
"""Longer than any blocking read the worker makes (at most a few tens of milliseconds)."""
CLUSTER_IDLE_POLL_S = 0.010
"""How often an idle worker on a Redis Cluster reads every shard while it would block on one Redis (one
``XREADGROUP BLOCK`` cannot wait on streams of several slots)."""

_MSG = "msg"
_PUBLISH = b"*3\r\n$7\r\nPUBLISH\r\n"
_SPUBLISH = b"*3\r\n$8\r\nSPUBLISH\r\n"
_REROUTED = (
    MovedError,
    ClusterDownError,
    TryAgainError,
    redis.ConnectionError,
    redis.TimeoutError,
    RedisClusterException,
)
"""What a shard's write meets while its slot has no reachable primary (not yet promoted, or the slot map is
stale; ``RedisClusterException``: no node covers the slot, or none answers): read the map again and retry."""

Written = TypeVar("Written")
Item = TypeVar("Item")

_StreamReply: TypeAlias = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]
"""``XREADGROUP``'s reply (RESP2): per stream, its entries as ``(entry id, fields)``."""


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where a taken request sits in its stream (to acknowledge it once finished) and its payload
    (to queue it again when handed back)."""

    stream: str
    entry_id: str
    raw: bytes


@dataclass(frozen=True, slots=True)
class _WireNames:
    """Where a request's events go, each name packed as a RESP bulk string: its relay's reply channel
    (None: the request names no relay, its events go one by one to its own token channel), its own
    token channel, and its record's event list."""

    reply: bytes | None
    channel: bytes
    events: bytes
    reply_name: str | None = None
    """The reply channel unpacked (what a cluster's ``SPUBLISH`` names)."""

    @classmethod
    def of(cls, keys: Keys, request_id: str, reply_to: str | None = None) -> _WireNames:
        reply_name = keys.reply_channel(reply_to) if reply_to is not None else None
        reply = bulk(reply_name.encode()) if reply_name is not None else None
        channel, events = bulk(keys.token_channel(request_id).encode()), bulk(keys.run_events(request_id).encode())
        return cls(reply, channel, events, reply_name)


def redis_client(url: str) -> SyncClient:
    """A binary-safe client of ``url`` (any ``MET_REDIS_URL`` form) that retries commands with capped
    exponential backoff and follows a sentinel failover, or a Redis Cluster's slot moves."""
    return connect_sync(
        url, retries=COMMAND_RETRIES, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
    )


class RedisTransport:
    """A ``WorkerTransport`` over one Redis client (``decode_responses=False``) and its pub/sub.

    Nothing touches Redis until the first call, so a worker can start while Redis is down. The
    consumer groups and the cancel subscription are (re)made on first use and after every connection
    error, so a restarted, empty Redis is picked up again. Entries of lost workers are taken over once
    idle for ``reclaim_idle_ms`` (default: one heartbeat TTL) with their heartbeat gone, looked for at
    most every half TTL. With ``poll_every_s``, a non-blocking ``receive`` that found nothing, and the
    pub/sub reads behind ``cancellations`` and ``controls``, are not repeated within that time: a busy
    worker stepping faster than that reads Redis once per interval, not once per step (a new request
    waits at most that much longer; an idle worker's blocking read is never skipped).
    """

    def __init__(
        self,
        client: SyncClient,
        *,
        worker_id: str,
        keys: Keys = DEFAULT_KEYS,
        heartbeat_ttl_s: int = 10,
        reclaim_idle_ms: int | None = None,
        replication: Replication = NO_WAIT,
        poll_every_s: float = 0.0,
    ) -> None:
        self._client: Any = client  # redis.Redis or redis.cluster.RedisCluster: the same commands
        self._router = SlotRouter(client) if isinstance(client, redis.cluster.RedisCluster) else None
        if self._router is not None and replication.replicas > 0:
            raise ValueError("MET_REDIS_WAIT_REPLICAS is not served on a Redis Cluster: leave it 0")
        if (self._router is not None) != (keys.shards > 1):
            raise ValueError(f"a Redis Cluster needs sharded keys and one Redis plain ones; got shards={keys.shards}")
        self._turn = 0  # which shard a take on a cluster reads first
        self._shard_reads = node_reads(self._router, worker_id) if self._router is not None else None
        self._stream_shards = {
            stream: shard for priority in Priority for shard, stream in enumerate(keys.request_streams(priority))
        }
        self._unsure_shards: set[int] = set()  # shards whose last publish transaction may or may not have run
        self._poll_every_s = poll_every_s
        self._next_poll = 0.0  # monotonic time before which a non-blocking ``receive`` reads nothing
        self._next_hear = 0.0  # likewise for the pub/sub connection
        self._waiter = ReplicaWaiter(replication, keys.replication_mark())
        # A begin or publish whose reply or confirmation was lost with Redis may have been written: the
        # call repeating it first asks the primary (without that, a failover would repeat record entries).
        self._unsure = False
        self._worker_id = worker_id
        self._keys = keys
        self._heartbeat_ttl_s = heartbeat_ttl_s
        self._pubsub = client.pubsub()
        # guards _entries, _names, _quiet, _started, _record_refreshes
        self._books = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # request -> its queue entry, while in flight here
        self._names: dict[str, _WireNames] = {}  # request -> its packed key names, while in flight here
        self._quiet: set[str] = set()  # requests in flight here that publish only their final events
        self._prepared = False
        self._prepared_before = False
        self._announcement: ModelAnnouncement | None = None
        self._started: dict[str, StartedRequest] = {}  # requests in flight here, for ``_restore``
        # request -> when its record's worker and TTL are next refreshed; absent: at its next append
        self._record_refreshes: dict[str, float] = {}
        self._cancelled: list[str] = []  # heard on the pub/sub connection, not yet taken
        self._taken: list[str] = []  # taken over by other workers after a lapsed heartbeat, not yet told
        self._beaten = False  # a heartbeat was written: its key missing at the next one means it lapsed
        self._controls: list[WorkerControl] = []
        idle_ms = reclaim_idle_ms if reclaim_idle_ms is not None else heartbeat_ttl_s * 1000
        self._reclaimer = Reclaimer(self._client, keys, worker_id, min_idle_ms=idle_ms, every_s=heartbeat_ttl_s / 2)

    def receive(self, max_new: int, block_ms: int, *, max_interactive: int | None = None) -> list[Received]:
        limits = receive_limits(max_new, max_interactive)
        if limits[Priority.INTERACTIVE] <= 0:
            return []
        polled_at = time.monotonic()
        if block_ms <= 0 and polled_at < self._next_poll:
            return []
        with self._unavailable_as_transport_error():
            self._prepare()
            entries = self._reclaim(max_new) if max_new > 0 else []
            for priority in Priority:
                if len(entries) < limits[priority]:
                    entries += self._read(priority, limits[priority] - len(entries))
            if not entries and block_ms > 0:  # batch entries that arrive meanwhile wait one more call
                entries = self._read(Priority.INTERACTIVE, limits[Priority.INTERACTIVE], block_ms)
            # Found nothing: the streams are read again (without blocking) only after ``poll_every_s``.
            self._next_poll = polled_at + self._poll_every_s if not entries else 0.0
            return self._accept(entries)

    def cancellations(self) -> list[str]:
        self._hear()
        cancelled, self._cancelled = self._cancelled, []
        return cancelled

    def controls(self) -> list[WorkerControl]:
        self._hear()
        controls, self._controls = self._controls, []
        return controls

    def _hear(self) -> None:
        """Read what the pub/sub connection holds: cancellations, and orders to this worker (at most
        every ``poll_every_s``)."""
        now = time.monotonic()
        if now < self._next_hear:
            return
        self._next_hear = now + self._poll_every_s
        with self._unavailable_as_transport_error():
            self._prepare()
            control_channel = self._keys.control_channel(self._worker_id).encode()
            while (message := self._next_message()) is not None:
                if message["type"] not in ("message", "smessage"):  # (un)subscribe confirmations
                    continue
                decoded = decode(message["data"])
                if message["channel"] == control_channel:
                    if isinstance(decoded, WorkerControl) and decoded.worker_id == self._worker_id:
                        self._controls.append(decoded)
                    else:
                        logger.warning("ignoring a control message not meant for this worker: %s", decoded)
                elif isinstance(decoded, CancelRequest):
                    self._cancelled.append(decoded.request_id)
                else:
                    logger.warning("ignoring a cancellation that is not a cancel message: %s", decoded)

    def _next_message(self) -> dict[str, Any] | None:
        if self._router is not None:
            return cast(dict[str, Any] | None, self._pubsub.get_sharded_message(timeout=0.0))
        return cast(dict[str, Any] | None, self._pubsub.get_message(timeout=0.0))

    def begin(self, started: Sequence[StartedRequest]) -> None:
        if not started:
            return

        def write() -> None:
            for _, shard_started in self._by_shard(started, lambda start: start.request_id).items():
                with self._client.pipeline(transaction=True) as pipe:
                    for start in shard_started:
                        seed, cached = start.seed, start.cached_tokens
                        record_start(pipe, start.request_id, seed=seed, cached_tokens=cached, keys=self._keys)
                    pipe.execute()

        with self._unavailable_as_transport_error():
            self._write_once(write, missing=lambda: self._lacks_seeds(started))
        with self._books:
            self._started.update((start.request_id, start) for start in started)

    def publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> None:
        self.start_publish(events, finished)()

    def start_publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> Callable[[], None]:
        """Send ``publish``'s transaction and return at once; the call returned reads its replies (and
        confirms it on the replicas asked for), raising ``TransportError`` as ``publish`` would. A call
        that repeats one that failed is written whole here, after asking the primary whether the
        failed one was written after all (``_write_once``)."""
        if not events and not finished:
            return _already_written
        now = time.monotonic()
        with self._books:
            quiet = {event.request_id for event in events if event.request_id in self._quiet}
        encoded = [encode(event) for event in events]

        def transaction() -> tuple[Transaction, list[str]]:
            return self._publish_transaction(events, encoded, finished, quiet, now)

        def missing() -> bool:
            return self._lacks(events, finished)

        def settle(refreshed: list[str]) -> None:
            with self._books:
                self._record_refreshes.update((request_id, now + RECORD_REFRESH_S) for request_id in refreshed)
                for done in finished:  # forgotten only once written: a failed publish is repeated as is
                    self._forget(done.request_id)

        if self._router is not None:
            with self._unavailable_as_transport_error():
                settle(self._publish_sharded(events, encoded, finished, quiet, now))
            return _already_written
        if self._unsure:
            with self._unavailable_as_transport_error():
                settle(self._write_once(lambda: self._execute(transaction()), missing=missing) or [])
            return _already_written
        with self._unavailable_as_transport_error():
            built, refreshed = transaction()
            self._unsure = True  # from the send until its replies are read, the write may or may not have run
            sent = send_transaction(self._client, built)

        def written() -> None:
            with self._unavailable_as_transport_error():
                sent.replies()
                self._waiter.confirm(self._client, missing=missing, write=lambda: self._execute(transaction()))
                self._unsure = False
            settle(refreshed)

        return written

    def _publish_sharded(
        self,
        events: Sequence[TokenEvent],
        encoded: list[bytes],
        finished: Sequence[FinishedRequest],
        quiet: set[str],
        now: float,
    ) -> list[str]:
        """``publish`` on a Redis Cluster: one transaction per shard (its requests' record appends and
        finishes), all sent before their replies are read; one that failed, or whose shard's last write may
        or may not have run, is written once by ``_write_shard``; then one ``SPUBLISH`` per reply channel
        of the step's group. The requests whose records were refreshed."""
        shard_events: dict[int, tuple[list[TokenEvent], list[bytes]]] = {}
        for event, payload in zip(events, encoded, strict=True):
            got = shard_events.setdefault(self._keys.shard_of(event.request_id), ([], []))
            got[0].append(event)
            got[1].append(payload)
        shard_finished = self._by_shard(finished, lambda done: done.request_id)
        groups: dict[str, list[bytes]] = {}  # per reply channel, in the order written
        refreshed: list[str] = []
        careful: list[tuple[int, Transaction, Callable[[], bool]]] = []  # written one by one, checked first
        by_node: dict[int, tuple[redis.Redis, list[tuple[int, Transaction, Callable[[], bool]]]]] = {}
        for shard in sorted({*shard_events, *shard_finished}):
            these, payloads = shard_events.get(shard, ([], []))
            done = shard_finished.get(shard, [])
            built, due = self._publish_transaction(these, payloads, done, quiet, now, groups=groups)
            refreshed += due
            missing: Callable[[], bool] = functools.partial(self._lacks, these, done)
            if not built:
                continue
            if shard in self._unsure_shards:
                careful.append((shard, built, missing))
                continue
            try:
                node = self._primary_of(shard)
            except _REROUTED:
                careful.append((shard, built, missing))
                continue
            by_node.setdefault(id(node), (node, []))[1].append((shard, built, missing))
        # Every node's transactions go in one write on one connection before any reply is read.
        batches: list[tuple[list[tuple[int, Transaction, Callable[[], bool]]], SentBatch | None]] = []
        for node, shards in by_node.values():
            self._unsure_shards.update(shard for shard, _, _ in shards)  # from the send until replies are read
            try:
                batches.append((shards, send_transactions(node, [built for _, built, _ in shards])))
            except _REROUTED:
                batches.append((shards, None))
        for shards, batch in batches:
            try:
                results: list[list[Any] | redis.ResponseError] = batch.replies() if batch is not None else []
            except _REROUTED:
                results = []
            for position, (shard, built, missing) in enumerate(shards):
                result = results[position] if position < len(results) else None
                if isinstance(result, list):
                    self._unsure_shards.discard(shard)
                elif result is None or isinstance(result, _REROUTED):  # cut off, or refused by a moved slot
                    careful.append((shard, built, missing))
                else:
                    raise result
        for shard, built, missing in careful:
            self._write_shard(shard, built, missing=missing)
        if groups:
            self._spublish(groups)
        return refreshed

    def _spublish(self, groups: dict[str, list[bytes]]) -> None:
        """``SPUBLISH`` each reply channel's group of the step on the primary owning the channel's slot, one
        plain pipeline per node. Best effort: the events are in their records, and a relay fills a gap
        when it next hears its channel, when it resubscribes after the failover that cost this, or after
        its ``idle_fill_s``."""
        assert self._router is not None
        by_node: dict[int, tuple[redis.Redis, list[tuple[str, bytes]]]] = {}
        try:
            for channel, grouped in groups.items():
                node = self._router.primary_for(channel)
                by_node.setdefault(id(node), (node, []))[1].append((channel, encode(TokenEventGroup(grouped))))
            for node, messages in by_node.values():
                with node.pipeline(transaction=False) as pipe:
                    for channel, payload in messages:
                        pipe.spublish(channel, payload)
                    pipe.execute()
        except _REROUTED as error:
            logger.warning("could not publish a step's token groups (%s): relays read the records", error)
            self._router.refresh_quietly()

    def _primary_of(self, shard: int) -> redis.Redis:
        assert self._router is not None
        return self._router.primary_for(self._keys.running_index(shard))

    def _router_send(self, shard: int, transaction: Transaction) -> SentTransaction:
        assert self._router is not None
        return self._router.send(self._keys.running_index(shard), transaction)

    def _write_shard(self, shard: int, transaction: Transaction, *, missing: Callable[[], bool]) -> None:
        """Write one shard's publish transaction on the primary that owns the shard now, exactly once: one
        that may have run (cut off with its primary) is written again only if the primary lacks it."""
        assert self._router is not None
        if not transaction:
            return
        for attempt in range(FAILOVER_RETRIES + 1):
            try:
                if shard in self._unsure_shards and not missing():
                    self._unsure_shards.discard(shard)
                    return
                self._unsure_shards.add(shard)
                self._router_send(shard, transaction).replies()
                self._unsure_shards.discard(shard)
                return
            except _REROUTED as error:
                if attempt == FAILOVER_RETRIES:
                    raise redis.ConnectionError(f"shard {shard} has no reachable primary: {error}") from error
                time.sleep(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt))
                self._router.refresh_quietly()

    def _by_shard(self, items: Sequence[Item], request_of: Callable[[Item], str]) -> dict[int, list[Item]]:
        """``items`` grouped by the shard of their request, in their order (one group on one Redis)."""
        grouped: dict[int, list[Item]] = {}
        for item in items:
            grouped.setdefault(self._keys.shard_of(request_of(item)), []).append(item)
        return grouped

    def _publish_transaction(
        self,
        events: Sequence[TokenEvent],
        encoded: list[bytes],
        finished: Sequence[FinishedRequest],
        quiet: set[str],
        now: float,
        *,
        groups: dict[str, list[bytes]] | None = None,
    ) -> tuple[Transaction, list[str]]:
        """The transaction of one ``publish``, and the requests whose records it refreshes: the events
        of requests that name no relay, one group per reply channel, then the record appends. With
        ``groups`` (a cluster), the reply channels' events are added there for the caller to publish
        after the transaction, and a request without a relay publishes with ``SPUBLISH`` (its channel
        shares its shard's slot)."""
        payloads: dict[str, list[bytes]] = {}  # per request, in seq order
        grouped_here: dict[bytes, list[bytes]] = {}  # per reply channel (packed), in the order written
        own_channel = _PUBLISH if groups is None else _SPUBLISH
        transaction = Transaction()
        for event, payload in zip(events, encoded, strict=True):
            payloads.setdefault(event.request_id, []).append(payload)
            if event.request_id not in quiet or event.seq == 0 or event.finished:  # the rest: from the record
                names = self._wire_names(event.request_id)
                if names.reply is not None and groups is not None and names.reply_name is not None:
                    groups.setdefault(names.reply_name, []).append(payload)
                elif names.reply is not None:
                    grouped_here.setdefault(names.reply, []).append(payload)
                else:
                    transaction.packed(own_channel + names.channel + bulk(payload))
        for reply, grouped in grouped_here.items():
            transaction.packed(_PUBLISH + reply + bulk(encode(TokenEventGroup(grouped))))
        for request_id, appended in payloads.items():
            rpush = b"*%d\r\n$5\r\nRPUSH\r\n" % (2 + len(appended))
            transaction.packed(b"".join([rpush, self._wire_names(request_id).events, *map(bulk, appended)]))
        with self._books:
            due = [request_id for request_id in payloads if now >= self._record_refreshes.get(request_id, now)]
        if due or finished:
            # ``shared/record.py``'s helpers queue the less frequent writes on a pipeline that only
            # gathers them: they join the same transaction, after the appends (a TTL needs the list).
            with self._gatherer() as gathered:
                for request_id in due:  # a request's first events from here, then every RECORD_REFRESH_S
                    refresh_record(gathered, request_id, worker_id=self._worker_id, keys=self._keys)
                for done in finished:
                    self._queue_finish(gathered, done)
                transaction.take_queued(gathered)
        return transaction, due

    def _gatherer(self) -> redis.client.Pipeline:
        """A pipeline that only gathers queued commands for ``Transaction.take_queued`` (never executed)."""
        if self._router is not None:  # a node's plain pipeline: the cluster's own would route each command
            return self._router.primary_for(self._keys.running_index(0)).pipeline(transaction=True)
        return cast(redis.client.Pipeline, self._client.pipeline(transaction=True))

    def _execute(self, built: tuple[Transaction, list[str]]) -> list[str]:
        """Write a transaction of ``_publish_transaction`` and wait for it; the records it refreshed."""
        execute_transaction(self._client, built[0])
        return built[1]

    def _wire_names(self, request_id: str) -> _WireNames:
        """The token channel and record list of a request, as packed bulk strings (kept while the
        request is in flight here)."""
        names = self._names.get(request_id)
        if names is None:
            names = _WireNames.of(self._keys, request_id)
        return names

    def _write_once(self, write: Callable[[], Written], *, missing: Callable[[], bool]) -> Written | None:
        """``write()``, confirmed on the replicas asked for, unless it repeats a call that failed after its
        write may have happened and the primary holds it already (then None)."""
        if self._unsure and not missing():
            self._unsure = False
            return None
        self._unsure = True
        written = write()
        self._waiter.confirm(self._client, missing=missing, write=write)
        self._unsure = False
        return written

    def _lacks(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> bool:
        """Whether the primary lacks the newest of ``events`` of some request, or a finished status."""
        newest: dict[str, int] = {}
        for event in events:
            newest[event.request_id] = max(event.seq, newest.get(event.request_id, -1))
        with self._client.pipeline(transaction=False) as pipe:
            for request_id in newest:
                pipe.lindex(self._keys.run_events(request_id), -1)
            for done in finished:
                pipe.hget(self._keys.run_record(done.request_id), "status")
            replies = pipe.execute()
        for seq, last in zip(newest.values(), replies, strict=False):
            stored = decode(last) if isinstance(last, bytes) else None
            if not isinstance(stored, TokenEvent) or stored.seq < seq:
                return True
        return any(_text(status or b"") != RunStatus.FINISHED.value for status in replies[len(newest) :])

    def _lacks_seeds(self, started: Sequence[StartedRequest]) -> bool:
        """Whether the primary lacks the seed of some of ``started``."""
        with self._client.pipeline(transaction=False) as pipe:
            for start in started:
                pipe.hget(self._keys.run_record(start.request_id), "seed")
            return any(seed is None for seed in pipe.execute())

    def _forget(self, request_id: str) -> None:
        """Drop what this transport keeps of a request that is no longer in flight here (under ``_books``)."""
        self._entries.pop(request_id, None)
        self._names.pop(request_id, None)
        self._quiet.discard(request_id)
        self._started.pop(request_id, None)
        self._record_refreshes.pop(request_id, None)

    def hand_back(self, request_ids: Sequence[str]) -> None:
        with self._books:
            entries = {request_id: self._entries[request_id] for request_id in request_ids}
        if not entries:
            return
        with self._unavailable_as_transport_error():
            for _, shard_ids in self._by_shard(list(entries), lambda request_id: request_id).items():
                with self._client.pipeline(transaction=True) as pipe:
                    for request_id in shard_ids:
                        entry = entries[request_id]
                        again: tuple[str, dict[str, str | bytes]] = (entry.stream, {_MSG: entry.raw})
                        queue_release(pipe, entry.stream, entry.entry_id, self._worker_id, then_add=again)
                        set_status(pipe, request_id, RunStatus.QUEUED, keys=self._keys)
                        record_released(pipe, request_id, keys=self._keys)
                    pipe.execute()
        with self._books:
            for request_id in entries:
                self._forget(request_id)

    def heartbeat(self, stats: WorkerHeartbeat) -> None:
        """Refresh the heartbeat; announce the model again if its key vanished (FLUSHDB, eviction) —
        a live worker whose model gateways cannot read would make them answer 404. A heartbeat that had
        lapsed since the last one means others took this worker for lost: ``taken_over`` then says which
        of its requests they took."""
        with self._unavailable_as_transport_error(), self._control_pipeline() as pipe:
            pipe.exists(self._keys.worker(self._worker_id))
            queue_heartbeat(pipe, stats, ttl_s=self._heartbeat_ttl_s, keys=self._keys)
            if self._announcement is not None:
                pipe.exists(self._keys.model(self._announcement.model))
            results = pipe.execute()
            if self._announcement is not None and not results[-1]:
                logger.warning("model announcement of %s vanished: announcing again", self._announcement.model)
                self._client.hset(self._keys.model(self._announcement.model), _MSG, encode(self._announcement))
            lapsed, self._beaten = self._beaten and not results[0], True
            if lapsed:
                self._find_taken_over()

    def taken_over(self) -> list[str]:
        taken, self._taken = self._taken, []
        return taken

    def _find_taken_over(self) -> None:
        """After a lapsed heartbeat: forget the requests whose entry another worker now holds (or, no
        longer pending, whose record names another worker), and keep them for ``taken_over``. An entry
        that is simply gone with an emptied Redis stays here: its record names this worker again."""
        with self._books:
            entries = list(self._entries.items())
        if not entries:
            return
        with self._client.pipeline(transaction=False) as pipe:
            for request_id, entry in entries:
                pipe.xpending_range(entry.stream, WORKER_GROUP, min=entry.entry_id, max=entry.entry_id, count=1)
                pipe.hget(self._keys.run_record(request_id), "worker")
            replies = pipe.execute(raise_on_error=False)
        me = self._worker_id.encode()
        taken = []
        for (request_id, _), pending, worker in zip(entries, replies[0::2], replies[1::2], strict=True):
            if isinstance(pending, Exception) or isinstance(worker, Exception):
                continue  # NOGROUP: Redis lost its data; nobody else holds it
            holder = pending[0]["consumer"] if pending else worker
            if holder is not None and holder != me:
                taken.append(request_id)
        with self._books:
            for request_id in taken:
                self._forget(request_id)
        if taken:
            logger.warning("heartbeat had lapsed: %d requests were taken over by other workers", len(taken))
        self._taken += taken

    def announce(self, model: ModelAnnouncement) -> None:
        with self._unavailable_as_transport_error():
            self._client.hset(self._keys.model(model.model), _MSG, encode(model))
        self._announcement = model

    def close(self) -> None:
        try:
            with self._unavailable_as_transport_error(), self._control_pipeline() as pipe:
                queue_withdrawal(pipe, self._worker_id, keys=self._keys)
                pipe.execute()
        finally:
            self._pubsub.close()
            self._client.close()

    def _control_pipeline(self) -> Any:
        """A pipeline for the worker's heartbeat, withdrawal and restored records: one ``MULTI`` on one
        Redis; on a cluster, whose keys here span slots, a plain pipeline (one round trip per node)."""
        return self._client.pipeline(transaction=self._router is None)

    def _prepare(self) -> None:
        """Make the consumer groups and subscribe to cancels. A group made again after the first time
        means Redis lost its data (restarted empty): what it held of this worker is written again."""
        if self._prepared:
            return
        made = False
        for priority in Priority:
            for stream in self._keys.request_streams(priority):
                try:
                    self._client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
                    made = True
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
        channels = (self._keys.cancel_channel(), self._keys.control_channel(self._worker_id))
        if self._router is not None:  # sharded pub/sub: kept on the shard owning each channel's slot
            for channel in channels:
                self._pubsub.ssubscribe(channel)
        else:
            self._pubsub.subscribe(*channels)
        self._prepared = True
        if made and self._prepared_before:
            self._restore()
        self._prepared_before = True

    def _restore(self) -> None:
        """Write again what a Redis that lost its data no longer holds of this worker: the model
        announcement and the records of the requests it runs (status, seed)."""
        with self._books:
            started = list(self._started.items())
            taken = [decode(entry.raw) for entry in self._entries.values()]
            self._record_refreshes.clear()  # event lists made again by the next appends need their TTL
        logger.warning("Redis lost its data (restarted empty?): rewriting %d records", len(started))
        with self._control_pipeline() as pipe:
            if self._announcement is not None:
                pipe.hset(self._keys.model(self._announcement.model), _MSG, encode(self._announcement))
            now = time.time()
            for request in taken:
                if isinstance(request, GenerateRequest):
                    record_taken(pipe, request, worker_id=self._worker_id, taken_at=now, keys=self._keys)
            for request_id, start in started:
                set_status(pipe, request_id, RunStatus.RUNNING, worker_id=self._worker_id, keys=self._keys)
                record_start(pipe, request_id, seed=start.seed, cached_tokens=start.cached_tokens, keys=self._keys)
            pipe.execute()

    def _reclaim(self, limit: int) -> list[TakenEntry]:
        with self._books:
            held_here = {entry.entry_id for entry in self._entries.values()}
        try:
            return self._reclaimer.claim(limit, held_here)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._prepared = False
            return []

    def _read(self, priority: Priority, count: int, block_ms: int | None = None) -> list[TakenEntry]:
        """Up to ``count`` new entries of one priority (of every shard's stream on a cluster)."""
        if self._router is not None:
            return self._read_shards(priority, count, block_ms or 0)
        stream = self._keys.request_stream(priority)
        try:
            reply = cast(
                _StreamReply | None,
                self._client.xreadgroup(WORKER_GROUP, self._worker_id, {stream: ">"}, count=count, block=block_ms),
            )
        except redis.ResponseError as exc:
            # NOGROUP: the group is gone; UNBLOCKED: the stream was deleted while this read blocked on it.
            if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                raise
            logger.warning("the consumer group on %s is gone (Redis restarted?); recreating it", stream)
            self._prepared = False
            return []
        return [TakenEntry(stream, _text(entry_id), fields, 1) for _, got in reply or [] for entry_id, fields in got]

    def _read_shards(self, priority: Priority, count: int, block_ms: int) -> list[TakenEntry]:
        """``_read`` on a cluster: every shard's stream, the first shard rotating per call; while nothing is
        found, read again every ``CLUSTER_IDLE_POLL_S`` until ``block_ms`` passed."""
        reads = self._shard_reads
        assert reads is not None
        deadline = time.monotonic() + block_ms / 1000
        while True:
            turn, self._turn = self._turn, self._turn + 1
            try:
                taken = take_from_shards(reads, self._keys, priority, count, turn)
            except redis.ResponseError as exc:
                if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                    raise
                logger.warning("a consumer group of %s is gone (Redis restarted?); recreating it", priority.value)
                self._prepared = False
                return []
            left = deadline - time.monotonic()
            if taken or left <= 0:
                return [TakenEntry(stream, _text(entry_id), fields, 1) for stream, entry_id, fields in taken]
            time.sleep(min(CLUSTER_IDLE_POLL_S, left))

    def _accept(self, entries: list[TakenEntry]) -> list[Received]:
        """Read the records of servable requests and mark them running; set every other entry aside.
        One ``MULTI``: the reads come first, so they see each record as it was before this take."""
        if not entries:
            return []
        shards: dict[int, tuple[list[tuple[TakenEntry, GenerateRequest]], list[DeadLetter]]] = {}
        dead: list[DeadLetter] = []
        for entry in entries:  # an entry's shard is its stream's, the shard of the request it holds
            message = self._register(entry)
            if message is None:
                continue
            held = shards.setdefault(self._stream_shards[entry.stream], ([], []))
            if isinstance(message, str):
                dead.append(DeadLetter(entry.stream, entry.entry_id, message, entry.fields.get(_MSG.encode(), b"")))
                held[1].append(dead[-1])
            else:
                held[0].append((entry, message))
        taken_at = time.time()
        delivered: list[GenerateRequest | Redelivery] = []
        for requests, letters in shards.values():
            with self._client.pipeline(transaction=True) as pipe:
                for _, message in requests:
                    queue_record_read(pipe, message.request_id, keys=self._keys)
                for _, message in requests:
                    record_taken(pipe, message, worker_id=self._worker_id, taken_at=taken_at, keys=self._keys)
                for letter in letters:
                    self._queue_dead_letter(pipe, letter)
                replies = pipe.execute()
            delivered += self._deliveries(requests, replies)
        # A take the promoted replica never heard of would be delivered again, maybe to another worker.
        self._waiter.confirm(self._client, missing=lambda: False, write=lambda: None)
        return [*dead, *delivered]

    def _register(self, entry: TakenEntry) -> GenerateRequest | str | None:
        """The entry's request, remembered as in flight here; or why it cannot be served (a second entry
        of a request already in flight here is a duplicate); or None for the very entry this worker
        holds, delivered again by a promoted replica that never heard of the first delivery."""
        message = parse_entry(entry.fields.get(_MSG.encode()))
        if isinstance(message, str):
            return message
        with self._books:
            held = self._entries.get(message.request_id)
            if held is not None and held.entry_id == entry.entry_id and held.stream == entry.stream:
                return None
            if held is not None:
                return DUPLICATE_REASON
            self._entries[message.request_id] = _Entry(entry.stream, entry.entry_id, encode(message))
            self._names[message.request_id] = _WireNames.of(self._keys, message.request_id, message.reply_to)
            if not message.live_events:
                self._quiet.add(message.request_id)
        return message

    def _deliveries(
        self, requests: list[tuple[TakenEntry, GenerateRequest]], replies: list[Any]
    ) -> list[GenerateRequest | Redelivery]:
        """Each request as first taken, or with its record when a worker ran it before."""
        taken: list[GenerateRequest | Redelivery] = []
        for position, (entry, message) in enumerate(requests):
            record = parse_record(message.request_id, replies[2 * position], replies[2 * position + 1])
            ran = entry.deliveries > 1 or ran_before(record)
            taken.append(Redelivery(message, record, entry.deliveries) if ran else message)
        return taken

    def _queue_dead_letter(self, pipe: redis.client.Pipeline, dead: DeadLetter) -> None:
        fields: dict[str, str | bytes] = {
            "reason": dead.reason,
            "stream": dead.stream,
            "entry_id": dead.entry_id,
            "raw": dead.raw,
        }
        letters = self._keys.dead_letter(self._stream_shards[dead.stream])  # the entry's shard: one slot
        queue_release(pipe, dead.stream, dead.entry_id, self._worker_id, then_add=(letters, fields))

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
        record_released(pipe, done.request_id, keys=self._keys)
        with self._books:
            entry = self._entries.get(done.request_id)
        if entry is None:
            return
        if done.dead_letter is not None:
            self._queue_dead_letter(pipe, DeadLetter(entry.stream, entry.entry_id, done.dead_letter, entry.raw))
        else:
            queue_release(pipe, entry.stream, entry.entry_id, self._worker_id)

    @contextmanager
    def _unavailable_as_transport_error(self) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException) as exc:
            self._prepared = False  # (a cluster: no node answers, or a shard has no primary yet)
            raise TransportError(f"Redis is unreachable: {exc}") from exc


def _already_written() -> None:
    """What ``start_publish`` returns for a write it finished itself."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
