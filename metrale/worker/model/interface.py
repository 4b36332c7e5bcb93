"""What the engine may ask of a model: forward a flat batch, move a sequence's state in and out.

The model never learns what a request is. It sees state slots (one per sequence, holding every KDA
layer's recurrent and conv state), MLA KV blocks, positions and token ids. The real implementation is
``metrale.worker.model.executor.ModelExecutor``; tests use a recording fake with the same interface.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

SequenceState = Mapping[str, torch.Tensor]
"""A sequence's whole state as named CPU tensors (see ``StatefulModel.export_state``)."""


@dataclass(frozen=True, slots=True)
class ForwardChunk:
    """One sequence's contiguous run of tokens inside a forward.

    Invariant: ``start`` is exactly the position the state in ``slot`` expects next. ``start == 0``
    means a fresh sequence: whatever the slot held is ignored and the state starts at zero.
    ``block_ids`` covers positions ``[0, start + len(token_ids))`` of the sequence's MLA cache.
    """

    slot: int
    block_ids: Sequence[int]
    start: int
    token_ids: Sequence[int]

    @property
    def end(self) -> int:
        """The position the state expects after this chunk."""
        return self.start + len(self.token_ids)


class StatefulModel(Protocol):
    """A model whose per-sequence state lives in preallocated pools addressed by slot and block ids."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def block_size(self) -> int:
        """Tokens per MLA KV block."""
        ...

    @property
    def num_slots(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    def forward(self, chunks: Sequence[ForwardChunk]) -> torch.Tensor:
        """Run every chunk, advancing each slot's state; return fp32 logits ``[len(chunks), vocab]``
        of each chunk's last token."""
        ...

    def export_state(self, slot: int, block_ids: Sequence[int], length: int) -> SequenceState:
        """Copy out the state after ``length`` consumed tokens: KDA slot state plus MLA KV ``[0, length)``.

        The result is a flat dict of CPU tensors, independent of the pools (bit-exact)."""
        ...

    def import_state(self, state: SequenceState, slot: int, block_ids: Sequence[int]) -> None:
        """Write a state produced by ``export_state`` into ``slot`` and ``block_ids`` (any free ones)."""
        ...

    def state_nbytes(self, length: int) -> int:
        """Bytes ``export_state`` produces for a sequence of ``length`` tokens."""
        ...
