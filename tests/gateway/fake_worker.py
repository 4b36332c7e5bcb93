"""A worker that speaks the fleet protocol without a model, so the gateway is tested without torch.

It announces one model and beats, takes requests from both streams with the ``workers`` group, and
answers each choice with the token ids ``reply(request, choice)`` scripts, ``tokens_per_event`` at a
time every ``step_s`` seconds. A choice stops (``stop``) at a stop token (kept in the output, as the
real worker does), at the end of its script, or (``length``) at ``max_tokens``. Logprobs are
``fake_logprob`` / ``fake_alternatives``. It honours cancels, and can misbehave on purpose: refuse a
request, leave an event out of pub/sub (``unpublished_seqs``, still in the record) or publish one twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio
from redis.exceptions import ResponseError

from metrale.shared.codec import decode, encode
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import (
    CancelRequest,
    FinishReason,
    GenerateRequest,
    ModelAnnouncement,
    Priority,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
)
from metrale.shared.record import RunStatus, append_tokens, set_status

Reply = Callable[[GenerateRequest, int], list[int]]
StreamEntry = tuple[bytes, bytes]
"""A request stream's name and an entry id in it."""


def fake_logprob(position: int) -> float:
    """The logprob the fake worker reports for the token at ``position`` of a choice."""
    return -0.5 - 0.01 * position


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

    client: redis.asyncio.Redis
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
        await self.client.hset(self.keys.worker(self.worker_id), "msg", encode(beat))
        await self.client.expire(self.keys.worker(self.worker_id), heartbeat_ttl_s)

    async def retire(self) -> None:
        """Delete the heartbeat, as a worker does when it exits."""
        await self.client.delete(self.keys.worker(self.worker_id))

    async def run(self) -> None:
        """Serve until ``stopping`` is set, each request in its own task (stopping waits for them).

        A flag, not task cancellation, ends the loops: on Python 3.11 redis-py's ``wait_for`` can
        swallow a cancel that arrives as a fakeredis reply completes."""
        for priority in Priority:
            with contextlib.suppress(ResponseError):  # BUSYGROUP
                await self.client.xgroup_create(self.keys.request_stream(priority), WORKER_GROUP, id="0", mkstream=True)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._listen_for_cancels())
            streams = {self.keys.request_stream(priority): ">" for priority in Priority}
            while not self.stopping.is_set():
                taken = await self.client.xreadgroup(WORKER_GROUP, self.worker_id, streams, count=8)
                if not taken:
                    await asyncio.sleep(0.005)
                for stream, entries in taken:
                    for entry_id, fields in entries:
                        request = decode(fields[b"msg"])
                        assert isinstance(request, GenerateRequest), request
                        self.requests.append(request)
                        tasks.create_task(self._serve(stream, entry_id, request))

    async def _listen_for_cancels(self) -> None:
        async with self.client.pubsub() as pubsub:
            await pubsub.subscribe(self.keys.cancel_channel())
            while not self.stopping.is_set():
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
                if message is not None:
                    cancel = decode(message["data"])
                    assert isinstance(cancel, CancelRequest), cancel
                    self.cancels.append(cancel)

    def _cancelled(self, request_id: str) -> bool:
        return self.stopping.is_set() or any(cancel.request_id == request_id for cancel in self.cancels)

    async def _serve(self, stream: bytes, entry_id: bytes, request: GenerateRequest) -> None:
        refusal = self.script.refuse(request)
        failure = self.script.fail(request)
        ending = (FinishReason.REFUSED, refusal) if refusal is not None else (FinishReason.ERROR, failure)
        choices = [_Choice(self.script.reply(request, index)) for index in range(request.n)]
        seq = 0
        while any(choice.finish_reason is None for choice in choices):
            await asyncio.sleep(self.script.step_s)
            events = []
            for index, choice in enumerate(choices):
                if choice.finish_reason is None:
                    events.append(self._step(request, index, choice, seq, ending))
                    seq += 1
            done = all(choice.finish_reason is not None for choice in choices)
            await self._write(request, events, (stream, entry_id) if done else None)

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

    async def _write(self, request: GenerateRequest, events: list[TokenEvent], done: StreamEntry | None) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            for event in events:
                copies = 0 if event.seq in self.script.unpublished_seqs else 1
                copies += event.seq in self.script.republished_seqs
                for _ in range(copies):
                    pipe.publish(self.keys.token_channel(request.request_id), encode(event))
                append_tokens(pipe, event, keys=self.keys)
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
            await pipe.execute()
