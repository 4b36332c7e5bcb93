"""The tensor form of one forward: a flat batch of rows from many sequences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metrale.worker.model.interface import ForwardChunk


@dataclass(frozen=True)
class BatchLayout:
    """Index tensors shared by every layer of one forward.

    Sequences are ordered decode-first: the first ``num_decode`` sequences feed one token each on top of
    carried state (rows ``[0, num_decode)``); the rest are prefill chunks (rows ``[num_decode, N)``),
    fresh (start 0) or continuing. ``order[j]`` is the caller's index of sequence ``j``.
    """

    token_ids: torch.Tensor  # [N] int64
    cu_seqlens: torch.Tensor  # [S+1] int64, rows of sequence s: cu_seqlens[s]:cu_seqlens[s+1]
    slots: torch.Tensor  # [S] int64 KDA slot of each sequence
    has_initial_state: torch.Tensor  # [S] bool, False where the chunk starts at position 0
    context_lens: torch.Tensor  # [S] int64, cached MLA tokens after this step (start + length)
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [N] int64, flat MLA cache index each row's latent is stored at
    last_rows: torch.Tensor  # [S] int64, the row whose logits are returned
    order: tuple[int, ...]
    num_decode: int

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def prefill_cu_seqlens(self) -> torch.Tensor:
        """``[P+1]`` offsets of the prefill sequences, relative to their first row ``num_decode``."""
        return self.cu_seqlens[self.num_decode :] - self.num_decode

    @classmethod
    def build(cls, chunks: Sequence[ForwardChunk], block_size: int, device: torch.device) -> BatchLayout:
        if not chunks:
            raise ValueError("a forward needs at least one chunk")
        for chunk in chunks:
            if not chunk.token_ids:
                raise ValueError(f"chunk for slot {chunk.slot} has no tokens")
            if len(chunk.block_ids) * block_size < chunk.end:
                raise ValueError(f"slot {chunk.slot}: {len(chunk.block_ids)} blocks cannot hold {chunk.end} tokens")
        order = sorted(range(len(chunks)), key=lambda i: not _is_decode(chunks[i]))
        ordered = [chunks[i] for i in order]
        lengths = [len(c.token_ids) for c in ordered]
        positions = [pos for c in ordered for pos in range(c.start, c.end)]
        row_blocks = [c.block_ids[pos // block_size] for c in ordered for pos in range(c.start, c.end)]
        max_blocks = max(len(c.block_ids) for c in ordered)
        cu = torch.tensor([0, *lengths]).cumsum(0)

        def tensor(values: Sequence[object], dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            token_ids=tensor([t for c in ordered for t in c.token_ids]),
            cu_seqlens=cu.to(device),
            slots=tensor([c.slot for c in ordered]),
            has_initial_state=tensor([c.start > 0 for c in ordered], torch.bool),
            context_lens=tensor([c.end for c in ordered]),
            block_tables=tensor([[*c.block_ids, *[0] * (max_blocks - len(c.block_ids))] for c in ordered]),
            slot_mapping=tensor([b * block_size + p % block_size for b, p in zip(row_blocks, positions, strict=True)]),
            last_rows=(cu[1:] - 1).to(device),
            order=tuple(order),
            num_decode=sum(_is_decode(c) for c in ordered),
        )


def _is_decode(chunk: ForwardChunk) -> bool:
    return len(chunk.token_ids) == 1 and chunk.start > 0
