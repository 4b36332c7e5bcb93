"""What one step does, in plain integers: the rows to feed, the states to move, the tokens to sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from metrale.worker.scheduler.sequence import FinishReason, SequenceId


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Feed ``token_ids`` at positions ``[start, end)`` to the state in ``slot``.

    ``block_ids`` covers positions ``[0, end)``. ``is_decode`` marks a row feeding only the newest
    sampled token; every other chunk is (part of) a prefill. ``num_draft > 0`` makes a decode chunk a
    verify chunk: its last ``num_draft`` tokens are draft tokens after the newest sampled one, and the
    state keeps only the rows up to the last one sampling accepts (speculative decoding).
    """

    seq_id: SequenceId
    slot: int
    block_ids: tuple[int, ...]
    start: int
    token_ids: tuple[int, ...]
    is_decode: bool
    num_draft: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def draft(self) -> tuple[int, ...]:
        """The draft tokens this chunk feeds after the newest sampled token (empty: none)."""
        return self.token_ids[len(self.token_ids) - self.num_draft :] if self.num_draft else ()


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """Sample the token at ``position`` for ``seq_id`` from the logits of chunk number ``row``.

    ``prompt_ids`` and ``output_ids`` are live views of the sequence, valid until ``postprocess``.
    With a ``draft`` (a verify chunk), the chunk's rows sample ``position`` and each draft token's
    next position too, every row as if the draft tokens before it had been accepted.
    """

    seq_id: SequenceId
    row: int
    position: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    draft: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Copy the state of ``seq_id`` (``length`` tokens) out of ``slot`` into host memory."""

    seq_id: SequenceId
    slot: int
    block_ids: tuple[int, ...]
    length: int


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Copy ``seq_id``'s parked state (``length`` tokens) into ``slot`` and ``block_ids``."""

    seq_id: SequenceId
    slot: int
    block_ids: tuple[int, ...]
    length: int


@dataclass(frozen=True, slots=True)
class Fork:
    """After the forward, copy ``parent``'s state (``length`` tokens) to ``child``.

    The copy goes into ``child_slot`` and ``child_block_ids``, or to host memory when ``child_slot``
    is None.
    """

    parent: SequenceId
    slot: int
    block_ids: tuple[int, ...]
    length: int
    child: SequenceId
    child_slot: int | None
    child_block_ids: tuple[int, ...]


@dataclass(slots=True)
class StepPlan:
    """One step, executed in this order: swap-outs, swap-ins, the forward of ``chunks``, forks, sampling.

    ``chunks`` is in row order: decode rows first, then prefill chunks. ``restarts`` names the
    sequences whose state was dropped this step; they prefill again from position 0 later.
    """

    chunks: list[ChunkPlan] = field(default_factory=list)
    samples: list[SampleSpec] = field(default_factory=list)
    swap_outs: list[SwapOut] = field(default_factory=list)
    swap_ins: list[SwapIn] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    restarts: list[SequenceId] = field(default_factory=list)

    @property
    def decodes(self) -> list[ChunkPlan]:
        return [chunk for chunk in self.chunks if chunk.is_decode]

    @property
    def prefills(self) -> list[ChunkPlan]:
        return [chunk for chunk in self.chunks if not chunk.is_decode]

    @property
    def preempted(self) -> bool:
        return bool(self.swap_outs or self.restarts)

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)


@dataclass(frozen=True, slots=True)
class FinalState:
    """Where a finished sequence's state is (``slot`` and ``block_ids``) and the tokens it consumed."""

    slot: int
    block_ids: tuple[int, ...]
    consumed: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.consumed)


@dataclass(frozen=True, slots=True)
class HeldState:
    """Where a live sequence's state is between steps: ``slot`` and ``block_ids``, or parked on the
    host (``slot`` None), after consuming exactly ``consumed``."""

    seq_id: SequenceId
    slot: int | None
    block_ids: tuple[int, ...]
    consumed: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SequenceUpdate:
    """What sampling did to one sequence: the token it emits (None for a withheld stop token), and
    why it finished, if it did.

    ``final_state`` locates the state of a sequence that finished (stop or length) in this step. Its
    slot and blocks are already free, but nothing overwrites them before the next forward.
    """

    seq_id: SequenceId
    token_id: int | None
    finish_reason: FinishReason | None
    final_state: FinalState | None = None
