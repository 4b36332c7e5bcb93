"""The wire-side life of one request on a worker: its token events, numbered, and how it ended."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from metrale.shared.messages import FinishReason, GenerateRequest, TokenEvent, Usage
from metrale.shared.record import RunRecord
from metrale.worker.engine.prompt_logprobs import PromptLogprobs
from metrale.worker.engine.request import RequestOutput
from metrale.worker.fleet.transport import FinishedRequest


@dataclass(slots=True)
class RequestTracker:
    """Turns one request's engine outputs into ``TokenEvent`` s and knows when all its choices ended.

    Invariant: ``next_seq`` is the number of events built so far, so the events of a request carry
    ``seq`` 0, 1, 2, ... across all its choices in the order they are built. A choice gets exactly
    one final event, carrying its ``Usage``. ``prompt_logprobs_next`` is the first prompt position
    whose logprob no event carried yet: a position the engine scores again (a request continued here
    after its worker was lost) is not sent twice.
    """

    message: GenerateRequest
    worker_id: str
    next_seq: int = 0
    completion_tokens: list[int] = field(init=False)
    finish_reasons: dict[int, FinishReason] = field(default_factory=dict)
    error: str | None = None
    cached_tokens: int = 0
    """Prompt tokens skipped by resuming from a checkpoint (reported in every choice's usage)."""
    taken_at: float = field(default_factory=time.monotonic)
    """When this worker took the request (``time.monotonic``)."""
    prompt_logprobs_next: int = 1

    def __post_init__(self) -> None:
        self.completion_tokens = [0] * self.message.n

    @classmethod
    def continuing(cls, message: GenerateRequest, worker_id: str, record: RunRecord) -> RequestTracker:
        """A tracker for a request that moved here, picking up where its ``record`` ends: the next
        ``seq``, the tokens each choice emitted, the choices already finished, the cached tokens."""
        tracker = cls(message, worker_id, next_seq=record.next_seq, cached_tokens=record.cached_tokens)
        for event in record.events:
            if event.prompt_logprobs is not None:
                tracker.prompt_logprobs_next += len(event.prompt_logprobs)
            if event.index < message.n:
                tracker.completion_tokens[event.index] += len(event.token_ids)
                if event.finish_reason is not None:
                    tracker.finish_reasons[event.index] = event.finish_reason
        return tracker

    @property
    def request_id(self) -> str:
        return self.message.request_id

    @property
    def resumable(self) -> bool:
        """Whether another worker can continue this request exactly: one choice, or nothing sent yet."""
        return self.message.n == 1 or self.next_seq == 0

    @property
    def done(self) -> bool:
        """Whether every choice has had its final event."""
        return len(self.finish_reasons) == self.message.n

    @property
    def prompt_logprobs_sent(self) -> bool:
        """Whether every prompt logprob the request asked for has been sent (or none was asked for)."""
        wanted = self.message.prompt_logprobs is not None
        return not wanted or self.prompt_logprobs_next >= len(self.message.prompt_token_ids)

    def on_output(self, output: RequestOutput) -> TokenEvent | None:
        """The event for one choice's output of a step; None when it brought nothing new."""
        if output.prompt_logprobs is not None:
            return self._prompt_event(output.prompt_logprobs)
        if not output.token_ids and not output.finished:
            return None
        wants_logprobs = self.message.logprobs is not None
        top_logprobs = None
        if self.message.logprobs:
            top_logprobs = [[(int(t), float(lp)) for t, lp in alternatives] for alternatives in output.top_logprobs]
        reason = FinishReason(output.finish_reason.value) if output.finish_reason is not None else None
        if output.error is not None:
            self.error = output.error
        return self._event(
            output.choice,
            list(output.token_ids),
            reason,
            logprobs=[float(lp) for lp in output.logprobs] if wants_logprobs else None,
            top_logprobs=top_logprobs,
        )

    def _prompt_event(self, scored: PromptLogprobs) -> TokenEvent | None:
        """The event for prompt logprobs, without the positions an earlier event carried."""
        skip = self.prompt_logprobs_next - scored.start
        if skip < 0:
            raise ValueError(f"{self.request_id}: prompt logprobs from {scored.start}, {self.prompt_logprobs_next} due")
        logprobs = [float(lp) for lp in scored.logprobs[skip:]]
        if not logprobs:
            return None
        self.prompt_logprobs_next += len(logprobs)
        top = None
        if self.message.prompt_logprobs:
            top = [[(int(t), float(lp)) for t, lp in alternatives] for alternatives in scored.top_logprobs[skip:]]
        event = TokenEvent(
            request_id=self.request_id,
            index=0,
            seq=self.next_seq,
            token_ids=[],
            worker_id=self.worker_id,
            prompt_logprobs=logprobs,
            prompt_top_logprobs=top,
        )
        self.next_seq += 1
        return event

    def finish_all(self, reason: FinishReason, error: str | None = None) -> list[TokenEvent]:
        """Final events, without tokens, for every choice still open (aborted, failed or refused)."""
        self.error = error
        open_choices = [choice for choice in range(self.message.n) if choice not in self.finish_reasons]
        return [self._event(choice, [], reason) for choice in open_choices]

    def outcome(self) -> FinishedRequest:
        """How the request ended, for its record: the finish reason of choice 0."""
        reason = self.finish_reasons[0]
        return FinishedRequest(self.request_id, reason, self.error if reason.is_error else None)

    def _event(
        self,
        choice: int,
        token_ids: list[int],
        reason: FinishReason | None,
        *,
        logprobs: list[float] | None = None,
        top_logprobs: list[list[tuple[int, float]]] | None = None,
    ) -> TokenEvent:
        self.completion_tokens[choice] += len(token_ids)
        usage = None
        if reason is not None:
            self.finish_reasons[choice] = reason
            prompt_tokens = len(self.message.prompt_token_ids)
            usage = Usage(prompt_tokens, self.completion_tokens[choice], cached_tokens=self.cached_tokens)
        event = TokenEvent(
            request_id=self.request_id,
            index=choice,
            seq=self.next_seq,
            token_ids=token_ids,
            worker_id=self.worker_id,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            finished=reason is not None,
            finish_reason=reason,
            error=self.error if reason is not None and reason.is_error else None,
            usage=usage,
        )
        self.next_seq += 1
        return event
