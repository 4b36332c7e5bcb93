"""Where the rows of a varlen batch go when every sequence is cut into chunks and all chunks run together.

Sequences are sorted by their number of chunks, longest first, and the chunks are laid out step-major:
first chunk 0 of every sequence, then chunk 1 of every sequence that has one, and so on. Step ``c`` of
a recurrence over chunks is then one contiguous block of chunks, and the sequences still running at
step ``c`` are a prefix of the sorted order, so their states are a prefix of one ``[S, ...]`` tensor.
The last chunk of a sequence is padded to the full chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkLayout:
    """The step-major chunk layout of one varlen batch (see the module docstring)."""

    chunk_size: int
    num_chunks: int
    row_positions: torch.Tensor  # [N] int64: index of each row in the padded [num_chunks * chunk_size] rows
    order: torch.Tensor  # [S] int64: the caller's sequence index of each sorted sequence
    steps: tuple[tuple[int, int], ...]  # (first chunk, number of chunks) of each step

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, chunk_size: int) -> ChunkLayout:
        """Lay out the sequences ``cu_seqlens`` (int64 ``[S+1]``, every length >= 1) in chunks of ``chunk_size``."""
        lengths = cu_seqlens.diff()
        chunks_per_sequence = (lengths + chunk_size - 1) // chunk_size
        order = torch.argsort(chunks_per_sequence, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order), device=order.device)
        step_index = torch.arange(int(chunks_per_sequence.max()), device=order.device)
        sizes = (chunks_per_sequence.unsqueeze(0) > step_index.unsqueeze(1)).sum(1)  # [steps]
        offsets = sizes.cumsum(0) - sizes

        sequence_of_row = torch.repeat_interleave(torch.arange(len(lengths), device=order.device), lengths)
        position = torch.arange(int(cu_seqlens[-1]), device=order.device) - cu_seqlens[sequence_of_row]
        chunk = offsets[position // chunk_size] + rank[sequence_of_row]
        sizes_list, offsets_list = sizes.tolist(), offsets.tolist()
        return cls(
            chunk_size=chunk_size,
            num_chunks=sum(sizes_list),
            row_positions=chunk * chunk_size + position % chunk_size,
            order=order,
            steps=tuple(zip(offsets_list, sizes_list, strict=True)),
        )

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``[N, H, *D]`` -> head-major chunks ``[M, H, L, *D]``, padding rows zero."""
        padded = x.new_zeros((self.num_chunks * self.chunk_size, *x.shape[1:]))
        padded[self.row_positions] = x
        chunks = padded.view(self.num_chunks, self.chunk_size, *x.shape[1:])
        return chunks.transpose(1, 2).contiguous()

    def to_rows(self, chunks: torch.Tensor) -> torch.Tensor:
        """Head-major chunks ``[M, H, L, *D]`` -> rows ``[N, H, *D]`` (padding dropped)."""
        return chunks.transpose(1, 2).flatten(0, 1)[self.row_positions]
