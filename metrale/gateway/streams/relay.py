"""Token events from Redis to the requests waiting for them: one pub/sub connection per gateway process.

``TokenRelay.open(request_id)`` subscribes the request's token channel and yields its ``EventStream``;
a background task (``run``) reads the shared connection and hands each event to its stream. Each wake-up
takes one message through redis-py's ``get_message`` and then, with ``drain`` (the default), every
reply that read brought in besides (``pubsub_drain.py``): each decoded once, each stream offered its
events together, so its reader wakes once per batch. ``drain=False`` takes one message per
``get_message``, the reference path. The channels of requests that ended are unsubscribed together, one
``UNSUBSCRIBE`` for those closed within ``UNSUBSCRIBE_AFTER_S``. Nothing a client sees depends on pub/sub
being lossless:

- a gap in ``seq`` (a lost message) is filled from the request's durable record at once;
- every subscribe confirmation, the first and those redis-py sends when it resubscribes after a
  reconnect, also reads the record, so events published while the connection was down arrive too
  (the worker writes the record in the same pipeline as the ``PUBLISH``, so it is never behind);
- a request that hears nothing for ``idle_fill_s`` reads its record too; a record that shows the
  request lost (``EventStream.note_record``) ends it with an error instead of a wait for its deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager, suppress
from typing import Any

import redis.asyncio
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, RedisError, TimeoutError

from metrale.gateway.streams.event_stream import EventStream
from metrale.gateway.streams.pubsub_drain import buffered_replies
from metrale.shared.codec import decode
from metrale.shared.dead_letters import add_dead_letter
from metrale.shared.keys import Keys
from metrale.shared.messages import TokenEvent
from metrale.shared.record import read_events_from_async

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""How long one read of the pub/sub connection waits for a message; ``close`` takes at most this long."""
UNSUBSCRIBE_AFTER_S = 0.05
"""How long the channels of closed requests gather before one ``UNSUBSCRIBE`` takes them all."""


class TokenRelay:
    """Fans the token channels of every open request in this process out of one pub/sub connection."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        keys: Keys,
        *,
        backoff_cap_s: float = 5.0,
        idle_fill_s: float = 5.0,
        drain: bool = True,
    ) -> None:
        self.idle_fill_s = idle_fill_s
        self._drain = drain
        self._client = client
        self._keys = keys
        self._pubsub = client.pubsub()
        self._backoff = ExponentialBackoff(cap=backoff_cap_s, base=0.05)
        self._streams: dict[str, EventStream] = {}  # channel name -> stream
        self._quiet: set[str] = set()  # channels of open requests that publish only their final events
        self._confirmed: set[str] = set()  # channels of open requests whose first subscribe was confirmed
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
        except (ConnectionError, TimeoutError) as error:
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
    async def open(self, request_id: str, *, live: bool = True) -> AsyncIterator[EventStream]:
        """Subscribe to ``request_id``'s events for the duration of the block.

        The subscription is sent before the block starts, so a request submitted inside it cannot
        publish before the gateway listens. A request without ``live`` events (``GenerateRequest.
        live_events``) hears only its first and final events: the gap before a final one is its
        expected way of reading the rest, from the record.
        """
        channel = self._keys.token_channel(request_id)
        stream = EventStream(request_id, fill=lambda: self._fill(stream), idle_fill_s=self.idle_fill_s)
        self._leaving.discard(channel)  # closed a moment ago and opened again: stays subscribed
        self._streams[channel] = stream
        if not live:
            self._quiet.add(channel)
        try:
            async with self._subscription_lock:
                await self._pubsub.subscribe(channel)
            yield stream
        finally:
            # No await here: a client disconnect cancels this task, and the unsubscribe must still go out.
            del self._streams[channel]
            self._quiet.discard(channel)
            self._confirmed.discard(channel)
            self._leaving.add(channel)
            if self._unsubscriber is None:
                self._unsubscriber = self._spawn(self._unsubscribe_leaving())

    async def run(self) -> None:
        """Read the pub/sub connection until closed; on a Redis error log, back off and go on."""
        failures = 0
        while not self._closing:
            try:
                await self._connect()
                message = await self._pubsub.get_message(timeout=POLL_S)
                if message is not None:
                    self._dispatch(message)
                    if self._drain:
                        await self._dispatch_buffered()
            except RedisError as error:  # redis-py's own retries (reconnect, resubscribe) are exhausted
                failures += 1
                delay = self._backoff.compute(failures)
                logger.warning("token relay lost Redis (%s); retrying in %.2f s", error, delay)
                await asyncio.sleep(delay)
                continue
            failures = 0
        logger.info("token relay stopped")

    async def _connect(self) -> None:
        """Open the pub/sub connection once. Under the lock: two tasks connecting at the same time
        would each take a connection from the pool, and subscribe on one while listening on the other."""
        if self._pubsub.connection is not None:  # the listener's every read passes here: no lock once open
            return
        async with self._subscription_lock:
            if self._pubsub.connection is None:
                await self._pubsub.connect()

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = message["channel"]
        channel = channel.decode() if isinstance(channel, bytes) else channel
        stream = self._streams.get(channel)
        if stream is None:
            return
        if message["type"] == "subscribe":
            resubscribed = channel in self._confirmed
            self._confirmed.add(channel)
            self._spawn(self._fill(stream, resubscribed=resubscribed))
        elif message["type"] == "message":
            self._deliver(channel, stream, message["data"])

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
                stream = self._streams.get(channel)
                event = self._decoded(stream, reply[2]) if stream is not None else None
                if event is not None:
                    batches.setdefault(channel, []).append(event)
                continue
            message = await self._pubsub.handle_message(reply)
            if message is not None:
                self._dispatch(message)
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
        except RedisError as error:
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
