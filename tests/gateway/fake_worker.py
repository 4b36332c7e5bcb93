"""A worker that speaks the fleet protocol without a model, so the gateway is tested without torch.

It announces one model and beats, takes requests from both streams with the ``workers`` group, and
answers each choice with the token ids ``reply(request, choice)`` scripts, ``tokens_per_event`` at a
time every ``step_s`` seconds. A choice stops (``stop``) at a stop token (kept in the output, as the
real worker does), at the end of its script, or (``length``) at ``max_tokens``. Logprobs are
``fake_logprob`` / ``fake_alternatives``. It honours cancels, and can misbehave on purpose: refuse a
request, leave an event out of pub/sub (``unpublished_seqs``, still in the record) or publish one twice.

Like a worker, it publishes each step's events as a ``TokenEventGroup`` on the reply channel the request
names, in the transaction that appends them to the record (a request naming no relay gets each event on
its own channel). On a Redis Cluster it does what a worker does there: it reads every shard's stream,
writes each request in a transaction of the request's slot, publishes the group after it (``SPUBLISH``)
and hears cancels by ``SSUBSCRIBE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio
from redis.exceptions import ResponseError

from metrale.shared.codec import decode, encode
from metrale.shared.heartbeats import queue_heartbeat, queue_withdrawal
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import (
    CancelRequest,
    FinishReason,
    GenerateRequest,
    ModelAnnouncement,
    Priority,
    TokenEvent,
    TokenEventGroup,
    Usage,
    WorkerHeartbeat,
)
from metrale.shared.record import RunStatus, append_tokens, set_status
from metrale.shared.redis_connect import is_cluster

Reply = Callable[[GenerateRequest, int], list[int]]
StreamEntry = tuple[bytes, bytes]
"""A request stream's name and an entry id in it."""


def fake_logprob(position: int) -> float:
    """The logprob the fake worker reports for the token at ``position`` of a choice."""
    return -0.5 - 0.01 * position


def fake_prompt_logprob(position: int) -> float:
    """The logprob the fake worker reports for the prompt token at ``position`` (from 1)."""
    return -1.0 - 0.1 * position


def fake_alternatives(token_id: int, position: int, count: int, vocab_size: int) -> list[tuple[int, float]]:
    """The ``count`` top alternatives the fake worker reports with a token."""
    return [((token_id + k) % vocab_size, fake_logprob(position) - 0.25 * k) for k in range(count)]


@dataclass
class FakeWorkerScript:
    """How the fake worker behaves."""

    reply: Reply
    step_s: float = 0.0
    tokens_per_event: int = 1
    cached_tokens: int = 0
    refuse: Callable[[GenerateRequest], str | None] = lambda request: None  # a reason: ends REFUSED
    fail: Callable[[GenerateRequest], str | None] = lambda request: None  # a reason: ends ERROR
    unpublished_seqs: frozenset[int] = frozenset()
    republished_seqs: frozenset[int] = frozenset()


@dataclass
class _Choice:
    tokens: list[int]
    emitted: int = 0
    finish_reason: FinishReason | None = None


@dataclass
class FakeWorker:
    """One fake worker on ``client``; ``requests`` and ``cancels`` record what it received."""

    client: redis.asyncio.Redis  # or a cluster's, which answers the same calls (``is_cluster``)
    keys: Keys
    announcement: ModelAnnouncement
    script: FakeWorkerScript
    worker_id: str = "fake-worker-0"
    requests: list[GenerateRequest] = field(default_factory=list)
    cancels: list[CancelRequest] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def announce(self, heartbeat_ttl_s: int = 60) -> None:
        """Write the model announcement and a heartbeat naming it."""
        now = time.time()
        beat = WorkerHeartbeat(self.worker_id, self.announcement.model, 0, 0, 0, 0, 0.0, 8, 64, now, now)
        await self.client.hset(self.keys.model(self.announcement.model), "msg", encode(self.announcement))
        async with self.client.pipeline(transaction=True) as pipe:
            queue_heartbeat(pipe, beat, ttl_s=heartbeat_ttl_s, keys=self.keys)
            await pipe.execute()

    async def retire(self) -> None:
        """Withdraw the heartbeat, as a worker does when it exits."""
        async with self.client.pipeline(transaction=True) as pipe:
            queue_withdrawal(pipe, self.worker_id, keys=self.keys)
            await pipe.execute()

    async def run(self) -> None:
        """Serve until ``stopping`` is set, each request in its own task (stopping waits for them).

        A flag, not task cancellation, ends the loops: on Python 3.11 redis-py's ``wait_for`` can
        swallow a cancel that arrives as a fakeredis reply completes."""
        streams = [stream for priority in Priority for stream in self.keys.request_streams(priority)]
        for stream in streams:
            with contextlib.suppress(ResponseError):  # BUSYGROUP
                await self.client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._listen_for_cancels())
            while not self.stopping.is_set():
                async with self.client.pipeline(transaction=False) as pipe:  # one stream a read: one slot
                    for stream in streams:
                        pipe.xreadgroup(WORKER_GROUP, self.worker_id, {stream: ">"}, count=8)
                    taken = [found for read in await pipe.execute() for found in read or []]
                if not taken:
                    await asyncio.sleep(0.005)
                for stream, entries in taken:
                    for entry_id, fields in entries:
                        request = decode(fields[b"msg"])
                        assert isinstance(request, GenerateRequest), request
                        self.requests.append(request)
                        tasks.create_task(self._serve(stream, entry_id, request))

    async def _listen_for_cancels(self) -> None:
        pubsub: Any = self.client.pubsub()
        try:
            if self._sharded:
                await pubsub.ssubscribe(self.keys.cancel_channel())
            else:
                await pubsub.subscribe(self.keys.cancel_channel())
            while not self.stopping.is_set():
                if self._sharded:
                    message = await pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=0.05)
                else:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
                if message is not None:
                    cancel = decode(message["data"])
                    assert isinstance(cancel, CancelRequest), cancel
                    self.cancels.append(cancel)
        finally:
            await pubsub.aclose()

    def _cancelled(self, request_id: str) -> bool:
        return self.stopping.is_set() or any(cancel.request_id == request_id for cancel in self.cancels)

    async def _serve(self, stream: bytes, entry_id: bytes, request: GenerateRequest) -> None:
        refusal = self.script.refuse(request)
        failure = self.script.fail(request)
        ending = (FinishReason.REFUSED, refusal) if refusal is not None else (FinishReason.ERROR, failure)
        choices = [_Choice(self.script.reply(request, index)) for index in range(request.n)]
        seq = 0
        if request.prompt_logprobs is not None and refusal is None and failure is None:
            events = self._prompt_events(request)
            seq = len(events)
            await self._write(request, events, None)
        while any(choice.finish_reason is None for choice in choices):
            await asyncio.sleep(self.script.step_s)
            events = []
            for index, choice in enumerate(choices):
                if choice.finish_reason is None:
                    events.append(self._step(request, index, choice, seq, ending))
                    seq += 1
            done = all(choice.finish_reason is not None for choice in choices)
            await self._write(request, events, (stream, entry_id) if done else None)

    def _prompt_events(self, request: GenerateRequest) -> list[TokenEvent]:
        """The prompt's logprobs in two events (positions ``1..len - 1``; none for a one-token prompt)."""
        prompt, count, vocab = request.prompt_token_ids, request.prompt_logprobs or 0, self.announcement.vocab_size
        positions = list(range(1, len(prompt)))
        halves = [half for half in (positions[: len(positions) // 2], positions[len(positions) // 2 :]) if half]
        return [
            TokenEvent(
                request_id=request.request_id,
                index=0,
                seq=seq,
                token_ids=[],
                worker_id=self.worker_id,
                prompt_logprobs=[fake_prompt_logprob(p) for p in half],
                prompt_top_logprobs=[fake_alternatives(prompt[p], p, count, vocab) for p in half] if count else None,
            )
            for seq, half in enumerate(halves)
        ]

    def _step(
        self, request: GenerateRequest, index: int, choice: _Choice, seq: int, ending: tuple[FinishReason, str | None]
    ) -> TokenEvent:
        """The choice's next event; ``ending`` (reason, message): end it at once with that error."""
        reason, error = ending
        if error is not None or self._cancelled(request.request_id):
            choice.finish_reason = reason if error is not None else FinishReason.ABORT
            return self._event(request, index, seq, [], choice, error=error)
        stops = set(request.stop_token_ids) | (set() if request.ignore_eos else set(self.announcement.eos_token_ids))
        start = choice.emitted
        tokens: list[int] = []
        for token in choice.tokens[start : start + self.script.tokens_per_event]:
            tokens.append(token)
            if token in stops:
                choice.finish_reason = FinishReason.STOP
                break
            if start + len(tokens) == request.max_tokens:
                choice.finish_reason = FinishReason.LENGTH
                break
        choice.emitted += len(tokens)
        if choice.emitted == len(choice.tokens) and choice.finish_reason is None:
            choice.finish_reason = FinishReason.STOP
        return self._event(request, index, seq, tokens, choice, start=start)

    def _event(
        self,
        request: GenerateRequest,
        index: int,
        seq: int,
        tokens: list[int],
        choice: _Choice,
        *,
        start: int = 0,
        error: str | None = None,
    ) -> TokenEvent:
        finished = choice.finish_reason is not None
        usage = Usage(len(request.prompt_token_ids), choice.emitted, self.script.cached_tokens) if finished else None
        wants_logprobs = request.logprobs is not None
        vocab = self.announcement.vocab_size
        return TokenEvent(
            request_id=request.request_id,
            index=index,
            seq=seq,
            token_ids=tokens,
            worker_id=self.worker_id,
            logprobs=[fake_logprob(start + i) for i in range(len(tokens))] if wants_logprobs else None,
            top_logprobs=[fake_alternatives(t, start + i, request.logprobs or 0, vocab) for i, t in enumerate(tokens)]
            if wants_logprobs
            else None,
            finished=finished,
            finish_reason=choice.finish_reason,
            error=error,
            usage=usage,
        )

    @property
    def _sharded(self) -> bool:
        return is_cluster(self.client)

    async def _write(self, request: GenerateRequest, events: list[TokenEvent], done: StreamEntry | None) -> None:
        assert request.reply_to is not None or not self._sharded, (
            "a cluster's gateway streams every request through its relay"
        )
        published: list[bytes] = []
        async with self.client.pipeline(transaction=True) as pipe:
            for event in events:
                copies = 0 if event.seq in self.script.unpublished_seqs else 1
                copies += event.seq in self.script.republished_seqs
                published += [encode(event)] * copies
                append_tokens(pipe, event, keys=self.keys)
            if request.reply_to is None:  # a request of an older gateway: each event on its own channel
                for payload in published:
                    pipe.publish(self.keys.token_channel(request.request_id), payload)
            if done is not None:
                stream, entry_id = done
                reasons = {event.index: event.finish_reason for event in events if event.finish_reason}
                error = next((event.error for event in events if event.error), None)
                set_status(
                    pipe,
                    request.request_id,
                    RunStatus.FINISHED,
                    worker_id=self.worker_id,
                    finish_reason=reasons.get(0, FinishReason.STOP) if error is None else FinishReason.ERROR,
                    error=error,
                    keys=self.keys,
                )
                pipe.xack(stream, WORKER_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
            group = None  # (the relay's channel, the step's events as one message)
            if request.reply_to is not None and published:
                group = (self.keys.reply_channel(request.reply_to), encode(TokenEventGroup(published)))
            if group is not None and not self._sharded:
                pipe.publish(*group)
            await pipe.execute()
        if group is not None and self._sharded:  # the relay's channel has a slot of its own
            await self.client.spublish(*group)
