"""Token events from Redis to the requests waiting for them: one pub/sub connection per gateway process.

Each relay has an id (``relay_id``) and its own reply channel (``Keys.reply_channel``), subscribed once: a
request submitted through it names it (``GenerateRequest.reply_to``, set by ``start_generation``), and its
worker publishes one ``TokenEventGroup`` per step there, holding the step's events of every request of
this relay; the relay decodes each group once and hands each event to its request's stream.
``TokenRelay.open(request_id)`` yields the request's ``EventStream``; for a request not submitted through
this relay (one read by attaching) it also subscribes the request's own token channel, where a worker
publishes the events of a request that names no relay (one submitted by an older gateway). A background
task (``run``) reads the shared connection. Each wake-up takes one message through redis-py's
``get_message`` and then, with ``drain`` (the default), every reply that read brought in besides
(``pubsub_drain.py``): each decoded once, each stream offered its events together, so its reader wakes
once per batch. ``drain=False`` takes one message per ``get_message``, the reference path. The channels of
requests that ended are unsubscribed together, one ``UNSUBSCRIBE`` for those closed within
``UNSUBSCRIBE_AFTER_S``. Nothing a client sees depends on pub/sub being lossless:

- a gap in ``seq`` (a lost message) is filled from the request's durable record at once;
- every subscribe confirmation, the first and those redis-py sends when it resubscribes after a
  reconnect, also reads the record (the reply channel's: every open request's), so events published
  while the connection was down arrive too
  (the worker writes the record in the same pipeline as the ``PUBLISH``, so it is never behind);
- a request that hears nothing for ``idle_fill_s`` reads its record too; a record that shows the
  request lost (``EventStream.note_record``) ends it with an error instead of a wait for its deadline.

On a Redis Cluster the reply channel is a sharded one (``SSUBSCRIBE``, on the shard owning the channel's
slot; redis-py's ``ClusterPubSub`` moves it to the promoted replica after a failover, and the new
subscription's confirmation reads every open request's record as a reconnect does). Requests' own token
channels are not subscribed there: every request streamed through a relay names it (``reply_to``), and a
cluster fleet has no older gateways. The listener takes one message per read (``drain`` needs the single
connection of a plain ``PubSub``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager, suppress
from typing import Any, cast

import redis.asyncio
import redis.asyncio.cluster
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, RedisClusterException, RedisError, TimeoutError

from metrale.gateway.streams.event_stream import EventStream
from metrale.gateway.streams.pubsub_drain import buffered_replies
from metrale.shared.codec import decode
from metrale.shared.dead_letters import add_dead_letter
from metrale.shared.keys import Keys
from metrale.shared.messages import TokenEvent, TokenEventGroup
from metrale.shared.record import read_events_from_async

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""How long one read of the pub/sub connection waits for a message; ``close`` takes at most this long."""
UNSUBSCRIBE_AFTER_S = 0.05
"""How long the channels of closed requests gather before one ``UNSUBSCRIBE`` takes them all."""
_UNAVAILABLE = (RedisError, RedisClusterException)
"""What a read of Redis raises while it (or every node of a cluster) cannot be reached."""
_SHARDED_TYPES = {"ssubscribe": "subscribe", "sunsubscribe": "unsubscribe", "smessage": "message"}


class TokenRelay:
    """Fans the token channels of every open request in this process out of one pub/sub connection."""

    def __init__(
        self,
        client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster,
        keys: Keys,
        *,
        backoff_cap_s: float = 5.0,
        idle_fill_s: float = 5.0,
        drain: bool = True,
        relay_id: str | None = None,
    ) -> None:
        self.idle_fill_s = idle_fill_s
        self.relay_id = relay_id if relay_id is not None else uuid.uuid4().hex
        """What requests streamed here name in ``GenerateRequest.reply_to``; unique per relay."""
        self._reply_channel = keys.reply_channel(self.relay_id)
        self._reply_subscribed = False
        self._sharded = isinstance(client, redis.asyncio.cluster.RedisCluster)
        self._drain = drain and not self._sharded
        self._client: redis.asyncio.Redis = client  # type: ignore[assignment]  # a cluster's has the same reads
        self._keys = keys
        self._pubsub: Any = client.pubsub()  # a ``PubSub``, or on a cluster a ``ClusterPubSub``
        self._backoff = ExponentialBackoff(cap=backoff_cap_s, base=0.05)
        self._streams: dict[str, EventStream] = {}  # channel name -> stream
        self._channels: dict[str, str] = {}  # request id -> its channel name, while open
        self._quiet: set[str] = set()  # channels of open requests that publish only their final events
        self._confirmed: set[str] = set()  # channels whose first subscribe was confirmed (reply, open requests')
        self._leaving: set[str] = set()  # channels of closed requests, not unsubscribed yet
        self._unsubscriber: asyncio.Task[None] | None = None  # unsubscribes ``_leaving`` soon
        self._subscription_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._listener: asyncio.Task[None] | None = None
        self._closing = False

    async def start(self) -> None:
        """Connect and start the listener task (if Redis is down, the listener keeps trying)."""
        if self._listener is not None:
            return
        try:
            await self._connect()
        except (ConnectionError, TimeoutError, RedisClusterException) as error:
            logger.warning("token relay cannot reach Redis yet: %s", error)
        self._listener = asyncio.create_task(self.run(), name="token-relay")
        self._listener.add_done_callback(_log_crash)

    async def close(self) -> None:
        """Stop the listener and close the pub/sub connection."""
        self._closing = True  # a cancel that redis-py's wait_for swallows (Python 3.11) still ends the loop
        tasks = [*self._background, *([self._listener] if self._listener else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task
        self._listener = None
        await self._pubsub.aclose()

    @asynccontextmanager
    async def open(self, request_id: str, *, live: bool = True, own_channel: bool = True) -> AsyncIterator[EventStream]:
        """Subscribe to ``request_id``'s events for the duration of the block.

        The subscription is sent before the block starts, so a request submitted inside it cannot
        publish before the gateway listens. A request without ``live`` events (``GenerateRequest.
        live_events``) hears only its first and final events: the gap before a final one is its
        expected way of reading the rest, from the record. Without ``own_channel``, for a request
        submitted inside the block naming this relay in ``reply_to``, only the relay's channel carries
        its events (subscribed before any request is): its own channel is not subscribed, which saves
        Redis and this process a ``SUBSCRIBE``, the record read its confirmation brings, and an
        ``UNSUBSCRIBE`` per request.
        """
        channel = self._keys.token_channel(request_id)
        stream = EventStream(request_id, fill=lambda: self._fill(stream), idle_fill_s=self.idle_fill_s)
        self._leaving.discard(channel)  # closed a moment ago and opened again: stays subscribed
        self._streams[channel] = stream
        self._channels[request_id] = channel
        if not live:
            self._quiet.add(channel)
        # On a cluster every request streamed here names this relay: there are no older gateways.
        subscribed = own_channel and not self._sharded
        try:
            if subscribed:
                async with self._subscription_lock:
                    await self._pubsub.subscribe(channel)
            yield stream
        finally:
            # No await here: a client disconnect cancels this task, and the unsubscribe must still go out.
            stream.close()
            del self._streams[channel]
            del self._channels[request_id]
            self._quiet.discard(channel)
            self._confirmed.discard(channel)
            if subscribed:
                self._leaving.add(channel)
            if self._leaving and self._unsubscriber is None:
                self._unsubscriber = self._spawn(self._unsubscribe_leaving())

    async def run(self) -> None:
        """Read the pub/sub connection until closed; on a Redis error log, back off and go on."""
        failures = 0
        while not self._closing:
            try:
                await self._connect()
                message = await self._next_message()
                if message is not None:
                    self._dispatch(message)
                    if self._drain:
                        await self._dispatch_buffered()
            except _UNAVAILABLE as error:  # redis-py's own retries (reconnect, resubscribe) are exhausted
                failures += 1
                delay = self._backoff.compute(failures)
                logger.warning("token relay lost Redis (%s); retrying in %.2f s", error, delay)
                await asyncio.sleep(delay)
                continue
            failures = 0
        logger.info("token relay stopped")

    async def _next_message(self) -> dict[str, Any] | None:
        """The next message of the pub/sub connection, within ``POLL_S``; a sharded one's types read as a
        plain one's (``ssubscribe`` as ``subscribe``, ``smessage`` as ``message``)."""
        if not self._sharded:
            return cast(dict[str, Any] | None, await self._pubsub.get_message(timeout=POLL_S))
        message = cast(dict[str, Any] | None, await self._pubsub.get_sharded_message(timeout=POLL_S))
        if message is not None:
            kind = message["type"]
            kind = kind.decode() if isinstance(kind, bytes) else kind
            message["type"] = _SHARDED_TYPES.get(kind, kind)
        return message

    async def _connect(self) -> None:
        """Open the pub/sub connection and subscribe the reply channel, once (redis-py subscribes it
        again on every reconnect). Under the lock: two tasks connecting at the same time would each take
        a connection from the pool, and subscribe on one while listening on the other."""
        if self._reply_subscribed:  # the listener's every read passes here: no lock once open
            return
        async with self._subscription_lock:
            if self._sharded and not self._reply_subscribed:  # it connects to the channel's shard here
                await self._pubsub.ssubscribe(self._reply_channel)
                self._reply_subscribed = True
            if self._sharded:
                return
            if self._pubsub.connection is None:
                await self._pubsub.connect()
            if not self._reply_subscribed:
                await self._pubsub.subscribe(self._reply_channel)
                self._reply_subscribed = True

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = message["channel"]
        channel = channel.decode() if isinstance(channel, bytes) else channel
        if channel == self._reply_channel:
            if message["type"] == "subscribe":  # events published while not subscribed: from the records
                resubscribed = self._confirm(channel)
                for open_stream in self._streams.values():
                    self._spawn(self._fill(open_stream, resubscribed=resubscribed))
            elif message["type"] == "message":
                batches: dict[str, list[TokenEvent]] = {}
                self._ungroup(message["data"], batches)
                self._offer_batches(batches)
            return
        stream = self._streams.get(channel)
        if stream is None:
            return
        if message["type"] == "subscribe":
            self._spawn(self._fill(stream, resubscribed=self._confirm(channel)))
        elif message["type"] == "message":
            self._deliver(channel, stream, message["data"])

    def _confirm(self, channel: str) -> bool:
        """Note ``channel``'s subscription confirmed; whether one was before (this one follows a reconnect)."""
        resubscribed = channel in self._confirmed
        self._confirmed.add(channel)
        return resubscribed

    async def _dispatch_buffered(self) -> None:
        """Dispatch every reply the pub/sub connection has read already: token events gathered per
        stream and offered together; anything else (subscribe confirmations, pongs) through redis-py's
        ``handle_message``, as ``get_message`` would have."""
        batches: dict[str, list[TokenEvent]] = {}
        for reply in buffered_replies(self._pubsub.connection):
            if isinstance(reply, Exception):
                raise reply
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                channel = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
                if channel == self._reply_channel:
                    self._ungroup(reply[2], batches)
                    continue
                stream = self._streams.get(channel)
                event = self._decoded(stream, reply[2]) if stream is not None else None
                if event is not None:
                    batches.setdefault(channel, []).append(event)
                continue
            message = await self._pubsub.handle_message(reply)
            if message is not None:
                self._dispatch(message)
        self._offer_batches(batches)

    def _ungroup(self, payload: object, batches: dict[str, list[TokenEvent]]) -> None:
        """Add the events of a reply channel's ``TokenEventGroup`` to ``batches`` (by channel), those of
        requests open here; anything that does not decode is dead-lettered."""
        group = decode(payload) if isinstance(payload, bytes) else None
        if not isinstance(group, TokenEventGroup):
            reason = f"not a token event group: {group}" if group is not None else "not bytes"
            logger.warning("dead-lettered a message on relay %s's channel: %s", self.relay_id, reason)
            self._dead_letter(reason, f"reply channel of relay {self.relay_id}", payload)
            return
        for raw in group.events:
            event = decode(raw)
            if not isinstance(event, TokenEvent):
                logger.warning("dead-lettered an event of a group on relay %s's channel: %s", self.relay_id, event)
                self._dead_letter(f"not a token event: {event}", f"reply channel of relay {self.relay_id}", raw)
                continue
            channel = self._channels.get(event.request_id)
            if channel is not None:  # a request closed here already: dropped, as on its own channel
                batches.setdefault(channel, []).append(event)

    def _offer_batches(self, batches: dict[str, list[TokenEvent]]) -> None:
        for channel, events in batches.items():
            stream = self._streams.get(channel)
            if stream is not None:
                self._offer(channel, stream, events)

    def _deliver(self, channel: str, stream: EventStream, payload: bytes) -> None:
        event = self._decoded(stream, payload)
        if event is not None:
            self._offer(channel, stream, [event])

    def _decoded(self, stream: EventStream, payload: object) -> TokenEvent | None:
        """The token event in ``payload``; anything else is dead-lettered (None)."""
        event = decode(payload) if isinstance(payload, bytes) else None
        if isinstance(event, TokenEvent):
            return event
        reason = f"not a token event: {event}" if event is not None else "not bytes"
        logger.warning("dead-lettered a message on %s's channel: %s", stream.request_id, reason)
        self._dead_letter(reason, f"channel of {stream.request_id}", payload)
        return None

    def _offer(self, channel: str, stream: EventStream, events: list[TokenEvent]) -> None:
        stream.offer(events)
        if stream.has_gap:
            if channel not in self._quiet:
                logger.info("request %s: gap before seq %d, reading its record", stream.request_id, events[-1].seq)
            self._spawn(self._fill(stream))

    async def _unsubscribe_leaving(self) -> None:
        """After ``UNSUBSCRIBE_AFTER_S``, unsubscribe every channel closed meanwhile in one command
        (those opened again since left ``_leaving`` in ``open``); again while more were closed during
        the command."""
        try:
            while self._leaving:
                await asyncio.sleep(UNSUBSCRIBE_AFTER_S)
                async with self._subscription_lock:  # opens subscribe under it: none runs between take and send
                    channels = list(self._leaving)  # none is open: ``open`` takes its channel back out
                    self._leaving.clear()
                    if channels:
                        await self._pubsub.unsubscribe(*channels)
        except RedisError as error:  # those channels stay subscribed; their messages find no stream and are dropped
            logger.warning("could not unsubscribe %d channels: %s", len(channels), error)
        finally:
            self._unsubscriber = None

    async def _fill(self, stream: EventStream, *, resubscribed: bool = False) -> None:
        """Offer ``stream`` the events of its request's record from its ``next_seq`` on (those it already
        has are dropped). After a reconnect (``resubscribed``), say how many it lacked."""
        source = f"record of {stream.request_id}"
        try:
            events = await read_events_from_async(
                self._client,
                stream.request_id,
                stream.next_seq,
                keys=self._keys,
                on_damage=lambda reason, raw: self._dead_letter(reason, source, raw),
            )
        except _UNAVAILABLE as error:
            logger.warning("could not read request %s's record: %s", stream.request_id, error)
            return
        before = stream.next_seq
        stream.note_record(events)
        if resubscribed and stream.next_seq > before:
            logger.info(
                "request %s: %d events read from its record after a reconnect",
                stream.request_id,
                stream.next_seq - before,
            )

    def _dead_letter(self, reason: str, source: str, raw: object) -> None:
        payload = raw if isinstance(raw, bytes) else repr(raw).encode()
        self._spawn(add_dead_letter(self._client, self._keys, reason=reason, source=source, raw=payload))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task


def _log_crash(listener: asyncio.Task[None]) -> None:
    """A listener that died of a bug leaves every open request waiting for its deadline: say so loudly."""
    if not listener.cancelled() and listener.exception() is not None:
        logger.critical("token relay crashed; no token events are delivered", exc_info=listener.exception())
