"""What the engine takes in and gives back, per request and per choice."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from metrale.worker.engine.prompt_logprobs import PromptLogprobs
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.interface import SequenceState
from metrale.worker.scheduler.sequence import FinishReason, Priority


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """A verified checkpoint: the exact state after the first ``length`` tokens of the prompt followed
    by the request's ``generated`` tokens."""

    length: int
    state: SequenceState


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request: a prompt of token ids and how to continue it.

    ``include_stop_token`` keeps a matched stop (or EOS) token at the end of the output.
    ``arrival`` is a wall-clock stamp for latency metrics; the scheduler orders by its own counter.
    ``resume`` starts from a checkpoint instead of position 0. With ``snapshots``, the engine hands
    out the state at every ``checkpoint_marks`` position and grid multiple of the prompt, every decode
    checkpoint interval of the output, and, with ``final_snapshot``, at the end (see
    ``Engine.take_snapshots``).
    ``generated`` continues a request that moved from another worker (``n == 1``): the tokens it
    already emitted, which this engine feeds after the prompt, one per step as decode rows, just as
    they were first fed; sampling then goes on at the next position exactly as the first worker would
    have (same state, seed, positions and penalties).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.INTERACTIVE
    arrival: float = field(default_factory=time.time)
    include_stop_token: bool = True
    resume: ResumePoint | None = None
    snapshots: bool = False
    final_snapshot: bool = True
    checkpoint_marks: tuple[int, ...] = ()
    generated: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "checkpoint_marks", tuple(self.checkpoint_marks))
        object.__setattr__(self, "generated", tuple(self.generated))


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one choice: tokens new since its previous output, with their
    logprobs (and top alternatives when asked for). An output with ``prompt_logprobs`` (choice 0, no
    tokens, not finished) carries prompt logprobs its prefill scored; it comes before the same step's
    token outputs of the request."""

    request_id: str
    choice: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    error: str | None = None
    """Why the choice was refused (``finish_reason`` ``REFUSED``)."""
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class Completion:
    """One choice's whole output."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None

    def extend(self, output: RequestOutput) -> None:
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(output.logprobs)
        self.top_logprobs.extend(output.top_logprobs)
        if output.finished:
            self.finish_reason = output.finish_reason
            self.error = output.error


@dataclass(slots=True)
class GenerationResult:
    """One prompt's result from ``Engine.generate``: its ``n`` completions, by choice index, and the
    logprobs of its prompt tokens from position 1 on (when its params asked for them)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    completions: list[Completion]
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(completion.finish_reason is not None for completion in self.completions)
