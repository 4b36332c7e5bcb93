"""What a client of the fleet sees: streamed completions read like an OpenAI client reads them, and
every token event any worker published, heard on a pattern subscription (on a Redis Cluster, whose
sharded channels take no patterns, read from the requests' records)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import redis

from metrale.shared.codec import decode
from metrale.shared.keys import Keys
from metrale.shared.messages import TokenEvent, TokenEventGroup
from metrale.shared.redis_connect import connect_sync, sync_client
from metrale.shared.redis_url import parse_redis_url


@dataclass
class Streamed:
    """One streamed completion as received: its id, text, finish reasons, errors, and whether it
    ended with ``[DONE]``."""

    request_id: str | None = None
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False

    def take(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk:
            self.errors.append(chunk["error"])
            return
        self.request_id = chunk["id"]
        for choice in chunk["choices"]:
            self.text += choice.get("text") or ""
            if choice.get("finish_reason"):
                self.finish_reasons.append(choice["finish_reason"])


async def stream_completion(client: httpx.AsyncClient, body: dict[str, Any]) -> Streamed:
    """POST ``body`` to ``/v1/completions`` with ``stream`` on and read it to its end."""
    streamed = Streamed()
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            streamed.errors.append({"status": response.status_code, "body": response.text})
            return streamed
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                streamed.done = True
            else:
                streamed.take(json.loads(payload))
    return streamed


async def stream_all(base_url: str, bodies: Sequence[dict[str, Any]], timeout_s: float) -> list[Streamed]:
    """Stream every body at once; each must end within ``timeout_s``."""
    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        return await asyncio.wait_for(asyncio.gather(*(stream_completion(client, body) for body in bodies)), timeout_s)


class EventTap:
    """Every ``TokenEvent`` published under ``keys`` (on a request's own channel, or in a group on a
    relay's reply channel), by request, in arrival order (a thread). Its
    pattern subscription is made again when its connection is (after a Redis failover, say); events
    published meanwhile are not heard."""

    def __init__(self, url: str, keys: Keys) -> None:
        self.events: dict[str, list[TokenEvent]] = defaultdict(list)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._marks: dict[str, threading.Event] = {}
        self._keys = keys
        self._client = sync_client(url)
        self._pubsub = self._client.pubsub()
        self._pubsub.psubscribe(keys.token_channel_pattern(), keys.reply_channel_pattern())
        self._thread = threading.Thread(target=self._listen, name="event-tap", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, list[TokenEvent]]:
        with self._lock:
            return {request_id: list(events) for request_id, events in self.events.items()}

    def tokens_heard(self) -> int:
        with self._lock:
            return sum(len(e.token_ids) for events in self.events.values() for e in events)

    def catch_up(self, timeout_s: float = 30.0) -> None:
        """Return once every event Redis took before this call has been heard: a mark is published on
        a token channel and waited for (Redis delivers one subscription's messages in order)."""
        mark = f"tap-mark-{uuid.uuid4().hex}"
        heard = self._marks[self._keys.token_channel(mark)] = threading.Event()
        self._client.publish(self._keys.token_channel(mark), b"")
        assert heard.wait(timeout_s), "the event tap fell behind by more than its timeout"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()
        self._client.close()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                message = self._pubsub.get_message(timeout=0.1)
            except redis.ConnectionError:  # its retries are spent while no primary answers: go on trying
                time.sleep(0.1)
                continue
            if message is None or message["type"] != "pmessage":
                continue
            mark = self._marks.get(message["channel"].decode())
            if mark is not None:
                mark.set()
                continue
            decoded = decode(message["data"])
            events = [decode(raw) for raw in decoded.events] if isinstance(decoded, TokenEventGroup) else [decoded]
            with self._lock:
                for event in events:
                    if isinstance(event, TokenEvent):
                        self.events[event.request_id].append(event)


class RecordTap:
    """``EventTap``'s twin on a Redis Cluster: every ``TokenEvent`` written to the records under ``keys``,
    by request, in record order, read every ``every_s`` by a thread (a worker publishes a step's
    events only after writing them, so the records hold at least what a relay heard). The records
    of the requests are found by ``SCAN`` over every primary; reads that meet a failover are retried."""

    def __init__(self, url: str, keys: Keys, *, every_s: float = 0.02) -> None:
        self.events: dict[str, list[TokenEvent]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._keys = keys
        self._every_s = every_s
        self._client = connect_sync(url)
        self._thread = threading.Thread(target=self._listen, name="record-tap", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, list[TokenEvent]]:
        with self._lock:
            return {request_id: list(events) for request_id, events in self.events.items()}

    def tokens_heard(self) -> int:
        with self._lock:
            return sum(len(e.token_ids) for events in self.events.values() for e in events)

    def catch_up(self, timeout_s: float = 30.0) -> None:
        """Return once the records have been read after this call."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._read()
                return
            except (redis.RedisError, redis.exceptions.RedisClusterException):
                assert time.monotonic() < deadline, "the record tap could not read the records"
                time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._client.close()

    def _listen(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(redis.RedisError, redis.exceptions.RedisClusterException):
                self._read()  # one that meets a failover is read again next time
            self._stop.wait(self._every_s)

    def _read(self) -> None:
        names = [name.decode() for name in self._client.scan_iter(match=f"{self._keys.namespace}:run:*:events")]
        with self._client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.lrange(name, 0, -1)
            lists = pipe.execute()
        read: dict[str, list[TokenEvent]] = {}
        for raw_events in lists:
            events = [event for event in map(decode, raw_events) if isinstance(event, TokenEvent)]
            if events:
                read[events[0].request_id] = events
        with self._lock:
            self.events.update(read)


def event_tap(url: str, keys: Keys) -> EventTap | RecordTap:
    """The tap of the fleet on ``url``: its published events, or on a Redis Cluster its records."""
    return RecordTap(url, keys) if parse_redis_url(url).cluster else EventTap(url, keys)


def delivered(heard: Sequence[TokenEvent]) -> list[TokenEvent]:
    """The events a client is shown of one request, in ``seq`` order (the relay keeps a seq's first).

    A seq is published twice only while a worker whose heartbeat lapsed (starved on a loaded machine)
    has not yet learned, at its next beat, that another worker took its request over: then the two
    events carry the same tokens and come from different workers. Fails on anything else, and on a seq
    that is missing."""
    first: dict[int, TokenEvent] = {}
    for event in heard:
        kept = first.setdefault(event.seq, event)
        if kept is not event:
            assert kept.worker_id != event.worker_id, f"{event.worker_id} published seq {event.seq} twice"
            assert kept.token_ids == event.token_ids, f"seq {event.seq}: {kept} differs from {event}"
    assert sorted(first) == list(range(len(first))), f"a seq is missing: {sorted(first)}"
    return [first[seq] for seq in sorted(first)]


class Signalled(Protocol):
    """A fleet whose workers can be signalled by name."""

    def signal(self, name: str, signum: signal.Signals) -> None: ...

    def kill(self, name: str) -> None: ...


def kill_busiest_worker_when(tap: EventTap | RecordTap, tokens: int, fleet: Signalled) -> threading.Thread:
    """A thread that kills (``kill -9``) the worker streaming the most unfinished requests once
    ``tokens`` have been heard.

    The tap lags the workers on a loaded machine, so the workers it names may have finished their requests
    already. Every worker it names is therefore stopped first (SIGSTOP: none finishes anything while the
    tap catches up on everything they published), the one with the most requests still unfinished killed,
    and the others go on (SIGCONT). Stopping them one at a time let the others finish a short run while
    each candidate was tried in turn."""

    def unfinished_by_worker() -> Counter[str]:
        return Counter(events[-1].worker_id for events in tap.snapshot().values() if not events[-1].finished)

    def watch() -> None:
        while tap.tokens_heard() < tokens:
            time.sleep(0.005)
        names = list(unfinished_by_worker())
        for name in names:
            fleet.signal(name, signal.SIGSTOP)
        time.sleep(0.05)  # what they wrote before they stopped reaches Redis before the tap's mark
        tap.catch_up()
        busiest = [name for name, _ in unfinished_by_worker().most_common() if name in names]
        if busiest:
            fleet.kill(busiest[0])
        for name in names:
            if not busiest or name != busiest[0]:
                fleet.signal(name, signal.SIGCONT)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
