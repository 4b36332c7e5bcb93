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
class _Unsent:
    """Tokens of one choice decoded and not yet in an event, with their logprobs (when asked for)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None

    def then(self, later: _Unsent) -> _Unsent:
        """These tokens followed by ``later`` ones."""
        logprobs = self.logprobs + later.logprobs if self.logprobs is not None and later.logprobs is not None else None
        top = self.top_logprobs
        if top is not None and later.top_logprobs is not None:
            top = top + later.top_logprobs
        return _Unsent(self.token_ids + later.token_ids, logprobs, top)


@dataclass(slots=True)
class RequestTracker:
    """Turns one request's engine outputs into ``TokenEvent`` s and knows when all its choices ended.

    Invariant: ``next_seq`` is the number of events built so far, so the events of a request carry
    ``seq`` 0, 1, 2, ... across all its choices in the order they are built. A choice gets exactly
    one final event, carrying its ``Usage``. ``prompt_logprobs_next`` is the first prompt position
    whose logprob no event carried yet: a position the engine scores again (a request continued here
    after its worker was lost) is not sent twice.

    ``stream_interval`` (vLLM's option of that name): a choice's tokens are held back until it holds that
    many, except its first event (sent at once: time to first token is not delayed) and its final one;
    held tokens are ``unsent`` and leave with the next event of their choice, or by ``take_unsent``
    (the worker calls it for every request each ``stream_interval``-th step, so that every stream's
    events leave in one write, and before a checkpoint of the request's state is stored or the request is
    handed back, so that its record holds every token that state consumed). At 1 every output is an
    event of its own.
    """

    message: GenerateRequest
    worker_id: str
    next_seq: int = 0
    stream_interval: int = 1
    completion_tokens: list[int] = field(init=False)
    finish_reasons: dict[int, FinishReason] = field(default_factory=dict)
    error: str | None = None
    cached_tokens: int = 0
    """Prompt tokens skipped by resuming from a checkpoint (reported in every choice's usage)."""
    taken_at: float = field(default_factory=time.monotonic)
    """When this worker took the request (``time.monotonic``)."""
    prompt_logprobs_next: int = 1
    _unsent: dict[int, _Unsent] = field(default_factory=dict, init=False)
    """Per choice, its tokens held back by ``stream_interval``."""

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, not {self.stream_interval}")
        self.completion_tokens = [0] * self.message.n

    @classmethod
    def continuing(
        cls, message: GenerateRequest, worker_id: str, record: RunRecord, *, stream_interval: int = 1
    ) -> RequestTracker:
        """A tracker for a request that moved here, picking up where its ``record`` ends: the next
        ``seq``, the tokens each choice emitted, the choices already finished, the cached tokens."""
        tracker = cls(
            message,
            worker_id,
            next_seq=record.next_seq,
            cached_tokens=record.cached_tokens,
            stream_interval=stream_interval,
        )
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

    @property
    def unsent(self) -> bool:
        """Whether some choice holds tokens back (``stream_interval``)."""
        return bool(self._unsent)

    def on_output(self, output: RequestOutput) -> TokenEvent | None:
        """The event for one choice's output of a step; None when it brought nothing new, or when its
        tokens are held back to leave with a later event (``stream_interval``)."""
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
        logprobs = [float(lp) for lp in output.logprobs] if wants_logprobs else None
        tokens = _Unsent(list(output.token_ids), logprobs, top_logprobs)
        held = self._unsent.pop(output.choice, None)
        if held is not None:
            tokens = held.then(tokens)
        started = self.completion_tokens[output.choice] > 0  # its first event is not held back
        if reason is None and started and len(tokens.token_ids) < self.stream_interval:
            self._unsent[output.choice] = tokens
            return None
        return self._event(output.choice, tokens, reason)

    def take_unsent(self) -> list[TokenEvent]:
        """Events for the tokens every choice holds back (none when nothing is held)."""
        held, self._unsent = self._unsent, {}
        return [self._event(choice, tokens, None) for choice, tokens in sorted(held.items())]

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
        nothing = _Unsent([], None, None)
        return [self._event(choice, self._unsent.pop(choice, nothing), reason) for choice in open_choices]

    def outcome(self) -> FinishedRequest:
        """How the request ended, for its record: the finish reason of choice 0."""
        reason = self.finish_reasons[0]
        return FinishedRequest(self.request_id, reason, self.error if reason.is_error else None)

    def _event(self, choice: int, tokens: _Unsent, reason: FinishReason | None) -> TokenEvent:
        self.completion_tokens[choice] += len(tokens.token_ids)
        usage = None
        if reason is not None:
            self.finish_reasons[choice] = reason
            prompt_tokens = len(self.message.prompt_token_ids)
            usage = Usage(prompt_tokens, self.completion_tokens[choice], cached_tokens=self.cached_tokens)
        event = TokenEvent(
            request_id=self.request_id,
            index=choice,
            seq=self.next_seq,
            token_ids=tokens.token_ids,
            worker_id=self.worker_id,
            logprobs=tokens.logprobs,
            top_logprobs=tokens.top_logprobs,
            finished=reason is not None,
            finish_reason=reason,
            error=self.error if reason is not None and reason.is_error else None,
            usage=usage,
        )
        self.next_seq += 1
        return event
