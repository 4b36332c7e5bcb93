"""One generated continuation of a request: its tokens, how far its state got, and where it lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum, StrEnum, auto
from typing import NamedTuple


class Priority(IntEnum):
    """Lower runs first."""

    INTERACTIVE = 0
    BATCH = 1


class SequenceStatus(Enum):
    WAITING = auto()
    """Holds no state anywhere; (re)starts its prefill from position 0 when admitted."""
    RUNNING = auto()
    """Owns a state slot and KV blocks."""
    SWAPPED = auto()
    """Its exact state is parked in host memory, keyed by its ``SequenceId``."""
    FINISHED = auto()


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    REFUSED = "refused"
    """Set by the engine, never the scheduler: the choice's grammar allowed no token (a dead end)."""


class SequenceId(NamedTuple):
    """Names a sequence (and the state it owns) independently of any slot."""

    request_id: str
    choice: int


@dataclass(frozen=True, slots=True)
class StopParams:
    """The part of a request's sampling parameters the scheduler needs: when a sequence ends."""

    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_token: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(slots=True, eq=False)
class Sequence:
    """A prompt plus the tokens generated so far for one choice of a request.

    Invariant: the state (wherever it lives) has consumed exactly ``tokens[0:num_computed]``. The
    newest sampled token is never consumed yet: a decode row feeds it.
    """

    seq_id: SequenceId
    prompt_ids: list[int]
    stop: StopParams
    priority: Priority
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    pending_forks: int = 0
    """Choices still to be forked from this sequence's state when its prompt prefill completes."""
    marks: tuple[int, ...] = ()
    """Prompt positions a prefill chunk must end at (the state there is checkpointed)."""
    replay_outputs: bool = False
    """Feed known output tokens one per step, as decode rows, exactly as they were first fed (a
    request continued from another worker's record reaches the same state bit for bit)."""
    finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens known but not yet consumed by the state."""
        return self.num_tokens - self.num_computed

    @property
    def rank(self) -> tuple[int, int, int]:
        """Scheduling order: smaller is served first and preempted last."""
        return (self.priority, self.arrival, self.seq_id.choice)

    @property
    def is_decoding(self) -> bool:
        """True when the only pending token is the newest sampled one."""
        return self.num_pending == 1 and bool(self.output_ids)

    def spawn(self, choice: int) -> Sequence:
        """Another choice of the same request, whose state is a copy of this one's after the prompt."""
        return Sequence(
            SequenceId(self.seq_id.request_id, choice),
            self.prompt_ids,
            self.stop,
            self.priority,
            self.arrival,
            num_computed=len(self.prompt_ids),
        )

    def tokens_between(self, start: int, end: int) -> tuple[int, ...]:
        """Token ids at positions ``[start, end)`` of prompt + output."""
        split = len(self.prompt_ids)
        head = self.prompt_ids[start:end] if start < split else []
        tail = self.output_ids[max(start - split, 0) : max(end - split, 0)]
        return (*head, *tail)

    def append_sampled(self, token_id: int, max_model_len: int) -> tuple[int | None, FinishReason | None]:
        """Record a sampled token; return the token to emit (None: a withheld stop token) and the
        finish reason, if this token ends the sequence.

        A sequence ends at a stop token, at ``max_tokens`` outputs, or once it holds more than
        ``max_model_len`` tokens (its newest token could not be fed).
        """
        if token_id in self.stop.stop_token_ids:
            if not self.stop.include_stop_token:
                return None, FinishReason.STOP
            self.output_ids.append(token_id)
            return token_id, FinishReason.STOP
        self.output_ids.append(token_id)
        if len(self.output_ids) >= self.stop.max_tokens or self.num_tokens > max_model_len:
            return token_id, FinishReason.LENGTH
        return token_id, None
