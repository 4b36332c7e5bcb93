"""A submitted request seen from the gateway: ordered token events in, per-choice text deltas out.

``start_generation`` opens the request's stream on the relay, submits it naming that relay
(``reply_to``: its events come grouped on the relay's channel) and yields a ``Generation``;
when the block ends with the request still running on a worker (client gone, deadline, stop string
matched), it publishes a ``CancelRequest``. The cancel survives the cancellation of the block itself
(a client disconnect cancels the task that streams), so it is sent at once, not at the deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from metrale.gateway.fleet.dispatcher import Dispatcher
from metrale.gateway.metrics import GatewayMetrics, RequestClock
from metrale.gateway.streams.choice import ChoiceDecoder, ChoiceDelta
from metrale.gateway.streams.event_stream import EventStream
from metrale.gateway.streams.relay import TokenRelay
from metrale.gateway.streams.submission import Submission
from metrale.shared.errors import BadRequest, DeadlineExceeded, WorkerFailed
from metrale.shared.messages import FinishReason, TokenEvent, Usage

logger = logging.getLogger(__name__)

CLIENT_GONE = "client disconnected"
STOP_STRING_MATCHED = "stop string matched"
DEADLINE_PASSED = "deadline exceeded"


class Generation:
    """The deltas of one running request, read in ``seq`` order until every choice has finished."""

    def __init__(self, submission: Submission, events: EventStream, clock: RequestClock) -> None:
        request = submission.request
        self.request_id = request.request_id
        self._request = request
        self._events = events
        self._clock = clock
        remaining_s = (request.deadline - time.time()) if request.deadline is not None else float("inf")
        self._loop_deadline = asyncio.get_running_loop().time() + max(remaining_s, 0.0)
        self._ended_by_error = False
        self._events_read = 0
        self._on_complete = submission.on_complete
        self._prompt_scores = submission.prompt_scores
        stop_ids = set(request.stop_token_ids) | submission.model.stop_ids
        self.choices = [
            ChoiceDecoder(
                index,
                submission.model.tokenizer,
                request.prompt_token_ids,
                stop_strings=submission.stop_strings,
                stop_ids=stop_ids,
                skip_special_tokens=not submission.keeps_special_tokens,
            )
            for index in range(request.n)
        ]
        self.cancel_reason = CLIENT_GONE

    @property
    def finished(self) -> bool:
        """Whether every choice has finished (by the worker or by a stop string)."""
        for choice in self.choices:  # noqa: SIM110 (a loop, not all(...) of a generator: read several times per token)
            if choice.finish_reason is None:
                return False
        return True

    @property
    def worker_finished(self) -> bool:
        """Whether the worker has sent the final event of every choice."""
        return self._ended_by_error or all(choice.worker_finished for choice in self.choices)

    @property
    def has_ready_event(self) -> bool:
        """Whether the next event has arrived already, so the next ``next_delta`` need not wait.

        The stream releases events in ``seq`` order from 0, so ``next_seq`` counts those released.
        """
        return self._events.next_seq > self._events_read

    @property
    def usage(self) -> Usage:
        """Prompt tokens once, completion tokens summed over choices, cached tokens as reported."""
        return Usage(
            prompt_tokens=len(self._request.prompt_token_ids),
            completion_tokens=sum(choice.completion_tokens for choice in self.choices),
            cached_tokens=max(choice.cached_tokens for choice in self.choices),
        )

    async def next_delta(self) -> ChoiceDelta | None:
        """The next delta of a choice still running, or None once every choice has finished.

        Raises ``DeadlineExceeded`` at the request's deadline, ``BadRequest`` when the worker refused
        the request, ``WorkerFailed`` when the fleet failed it.
        """
        while not self.finished:
            event = await self._next_event()
            if event.prompt_logprobs is not None:  # no delta: prompt logprobs, gathered for the renderer
                if self._prompt_scores is not None:
                    self._prompt_scores.add(event)
                continue
            choice = self.choices[event.index]
            if choice.finished:  # stopped here by a stop string; the worker has not heard yet
                continue
            delta = choice.accept(event)
            if choice.index == 0 and choice.ended_by_worker and self._on_complete is not None:
                await self._on_complete(choice)
            self._clock.on_tokens(len(event.token_ids))
            if delta.finish_reason is not None:
                self._clock.on_choice_finished(delta.finish_reason)
            if self.finished:
                self._clock.on_request_finished(len(self._request.prompt_token_ids))
                self.cancel_reason = STOP_STRING_MATCHED
            return delta
        return None

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every delta until every choice has finished."""
        while (delta := await self.next_delta()) is not None:
            yield delta

    async def _next_event(self) -> TokenEvent:
        try:
            event = self._events.take_ready() or await self._events.next(self._loop_deadline)
        except TimeoutError:
            self.cancel_reason = DEADLINE_PASSED
            raise DeadlineExceeded(f"The request did not finish within its deadline ({self.request_id}).") from None
        self._events_read += 1
        if event.finish_reason is not None and event.finish_reason.is_error:
            self._ended_by_error = True
            reason = event.error or "no reason given"
            if event.finish_reason is FinishReason.REFUSED:
                raise BadRequest(f"The worker refused the request: {reason}")
            raise WorkerFailed(f"The request failed on the fleet: {reason}")
        if event.index >= len(self.choices):
            raise RuntimeError(f"request {self.request_id}: event for choice {event.index} of {len(self.choices)}")
        return event


@asynccontextmanager
async def start_generation(
    submission: Submission,
    *,
    relay: TokenRelay,
    dispatcher: Dispatcher,
    metrics: GatewayMetrics,
    attach: bool = False,
) -> AsyncIterator[Generation]:
    """Submit ``submission`` and yield its ``Generation``; cancel it on the worker if it is left running.

    With ``attach``, a request id that already has a record is not submitted again: its events are read
    from the record and its channel (the relay reads the record once subscribed)."""
    request_id = submission.request.request_id
    live = submission.request.live_events
    attached = attach and await dispatcher.has_record(request_id)
    # A request submitted here names this relay: its events come on the relay's channel, not its own.
    async with relay.open(request_id, live=live, own_channel=attached) as events:
        if not attached:
            await dispatcher.submit(dataclasses.replace(submission.request, reply_to=relay.relay_id))
        generation = Generation(submission, events, RequestClock(metrics, time.monotonic(), live=live))
        try:
            yield generation
        finally:
            if not generation.worker_finished:
                with anyio.CancelScope(shield=True):
                    await _cancel(dispatcher, request_id, generation.cancel_reason)


async def _cancel(dispatcher: Dispatcher, request_id: str, reason: str) -> None:
    try:
        await dispatcher.cancel(request_id, reason)
    except Exception as error:  # the request still ends at its deadline on the worker
        logger.warning("could not cancel request %s (%s): %s", request_id, reason, error)
    else:
        logger.info("cancelled request %s: %s", request_id, reason)
