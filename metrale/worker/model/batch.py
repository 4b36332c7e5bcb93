"""The tensor form of one forward: a flat batch of rows from many sequences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from metrale.worker.model.interface import ForwardChunk


@dataclass(frozen=True)
class BatchLayout:
    """Index tensors shared by every layer of one forward.

    Sequences are ordered decode-first: the first ``num_decode`` sequences feed one token each on top of
    carried state (rows ``[0, num_decode)``); the rest are prefill chunks (rows ``[num_decode, N)``),
    fresh (start 0) or continuing. ``order[j]`` is the caller's index of sequence ``j``.

    A ``verify`` chunk of ``L`` tokens becomes ``L`` one-row decode sequences, one per token, each with
    the context up to its own row (``context_lens``), all on the chunk's slot: attention treats each row
    as the decode row it would have been. They sit after the plain decode rows, step-major (``verify``):
    every verify chunk's first token, then every second token of chunks that have one, and so on, the
    longest chunks first; a recurrent layer steps them one row per chunk at a time (``layers/rows.py``).
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
    verify: VerifyRows | None = None

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
            if chunk.verify and chunk.start == 0:
                raise ValueError(f"slot {chunk.slot}: a verify chunk continues a state; it cannot start at 0")
        if any(chunk.verify for chunk in chunks):
            return cls._build_with_verify(chunks, block_size, device)
        order = sorted(range(len(chunks)), key=lambda i: not _is_decode(chunks[i]))
        return cls._from_sequences(order, [chunks[i] for i in order], block_size, device, None)

    @classmethod
    def _build_with_verify(cls, chunks: Sequence[ForwardChunk], block_size: int, device: torch.device) -> BatchLayout:
        plain = [i for i, c in enumerate(chunks) if _is_decode(c) and not c.verify]
        verify = sorted((i for i, c in enumerate(chunks) if c.verify), key=lambda i: -len(chunks[i].token_ids))
        prefill = [i for i, c in enumerate(chunks) if not _is_decode(c) and not c.verify]
        order, ordered = [*plain], [chunks[i] for i in plain]
        steps: list[tuple[int, int]] = []
        for step in range(len(chunks[verify[0]].token_ids)):
            running = [i for i in verify if len(chunks[i].token_ids) > step]
            steps.append((len(ordered), len(running)))
            for i in running:
                c = chunks[i]
                order.append(i)
                ordered.append(ForwardChunk(c.slot, c.block_ids, c.start + step, c.token_ids[step : step + 1]))
        order += prefill
        ordered += [chunks[i] for i in prefill]
        rows = VerifyRows(
            first_row=len(plain),
            steps=tuple(steps),
            slots=tuple(chunks[i].slot for i in verify),
            lengths=tuple(len(chunks[i].token_ids) for i in verify),
        )
        return cls._from_sequences(order, ordered, block_size, device, rows)

    @classmethod
    def _from_sequences(
        cls,
        order: list[int],
        ordered: list[ForwardChunk],
        block_size: int,
        device: torch.device,
        verify: VerifyRows | None,
    ) -> BatchLayout:
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
            verify=verify,
        )


@dataclass
class VerifyRows:
    """Where the rows of a forward's ``verify`` chunks are, and the states a recurrent layer keeps for them.

    Rows ``[first_row, first_row + sum(lengths))`` are theirs, step-major: step ``r`` is the rows
    ``[steps[r][0], steps[r][0] + steps[r][1])``, the ``r``-th token of the first ``steps[r][1]`` chunks
    (chunks sorted longest first: ``slots`` and ``lengths``). After step ``r`` a recurrent layer saves,
    for every chunk that has a step ``r + 1``, the state it holds then (``save``): the state after
    ``r + 1`` of its tokens. The state after all of a chunk's tokens stays in its slot.
    """

    first_row: int
    steps: tuple[tuple[int, int], ...]
    slots: tuple[int, ...]
    lengths: tuple[int, ...]
    saved: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    """Per pool tensor (by ``id``): the tensor, and per step ``r`` its rows ``[steps[r + 1][1], ...]``."""

    def step_rows(self) -> list[slice]:
        return [slice(first, first + count) for first, count in self.steps]

    def save(self, states: torch.Tensor, step: int, slots: torch.Tensor) -> None:
        """Keep ``states[slots]`` of the chunks that go on after ``step`` (``slots``: the step's slots)."""
        if step + 1 >= len(self.steps):
            return
        going_on = self.steps[step + 1][1]
        _, saved = self.saved.setdefault(id(states), (states, []))
        assert len(saved) == step, "steps are saved in order"
        saved.append(states[slots[:going_on]].clone())

    def settle(self, slot: int, rows: int) -> None:
        """Put back into ``slot``, in every saved pool tensor, the state after ``rows`` of its chunk's tokens."""
        index = self.slots.index(slot)
        length = self.lengths[index]
        if not 1 <= rows <= length:
            raise ValueError(f"slot {slot}: {rows} rows kept of a verify chunk of {length}")
        if rows == length:
            return
        for states, saved in self.saved.values():
            states[slot] = saved[rows - 1][index]


def _is_decode(chunk: ForwardChunk) -> bool:
    return len(chunk.token_ids) == 1 and chunk.start > 0
