"""Partial rotary position embedding: RoPE over the leading dims of each head, the rest passed through.

The rotation pairs dim ``i`` with dim ``i + R/2`` of the ``R`` rotary dims (``rotate_half``, not the
interleaved pairing). Qwen3.5's interleaved mRoPE reduces to this for text: its three position rows
(time, height, width) are the same 1-D positions, and recomposing equal frequencies changes nothing.
"""

from __future__ import annotations

import torch

from metrale.worker.model.batch import BatchLayout


def row_positions(layout: BatchLayout) -> torch.Tensor:
    """Position ``[N]`` int64 of every row in its sequence: a chunk's rows end at ``context_lens``."""
    lengths = layout.cu_seqlens.diff()
    ends = (layout.context_lens - layout.cu_seqlens[1:]).repeat_interleave(lengths, output_size=layout.num_rows)
    return ends + torch.arange(layout.num_rows, device=ends.device)


class PartialRotary:
    """``rotary_dim`` leading dims of each head rotated by ``position · theta^(-2i/rotary_dim)``."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        self.rotary_dim = rotary_dim
        # On the CPU explicitly: a model built on the meta device still needs real frequencies.
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        self.inv_freq = 1.0 / (theta**exponents)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[N, 1, R]`` in ``dtype`` for ``positions [N]`` (computed in fp32)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[N, H, D]`` by :meth:`angles`; dims past ``rotary_dim`` unchanged."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        first, second = rot.chunk(2, dim=-1)
        rotated = rot * cos + torch.cat([-second, first], dim=-1) * sin
        return torch.cat([rotated, rest], dim=-1)
