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
    ``every_row`` asks for the logits of every token of the chunk, not only its last (a prefill whose
    prompt logprobs are wanted).

    ``verify`` makes it a speculative chunk (``start > 0``): its first token is the sequence's pending
    token, the rest are draft tokens. The model computes each of its rows exactly as it computes a decode
    row (the recurrence stepped token by token, attention over the context up to that row), returns the
    logits of every row, and leaves the slot *unsettled*: ``StatefulModel.settle_verified`` then keeps
    the state after the first ``rows`` tokens, which must happen before the slot is used again.
    """

    slot: int
    block_ids: Sequence[int]
    start: int
    token_ids: Sequence[int]
    every_row: bool = False
    verify: bool = False

    @property
    def end(self) -> int:
        """The position the state expects after this chunk."""
        return self.start + len(self.token_ids)


def logit_row_counts(chunks: Sequence[ForwardChunk]) -> list[int]:
    """How many logit rows ``StatefulModel.forward`` returns for each chunk, in order."""
    return [len(chunk.token_ids) if chunk.every_row or chunk.verify else 1 for chunk in chunks]


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
        """Run every chunk, advancing each slot's state; return fp32 logits ``[rows, vocab]``: per chunk,
        in the order given, the logits of each of its tokens (``every_row``) or of its last one. Without
        ``every_row`` chunks that is ``[len(chunks), vocab]``, one row per chunk (``logit_row_counts``).
        A ``verify`` chunk returns every row's logits and leaves its slot unsettled."""
        ...

    def settle_verified(self, slot: int, rows: int) -> None:
        """Keep, in ``slot``, the state after the first ``rows`` tokens of the ``verify`` chunk the last
        forward fed it (``1 <= rows <= len(token_ids)``); the state after the later rows is dropped, so
        those positions are never consumed by the state that goes on. The attention cache keeps the
        dropped rows' entries past the context, where the next feed overwrites them."""
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
