"""Random Gated DeltaNet inputs and pools for the GDN kernel tests (torch, C and Triton alike)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import l2norm

POISON = 1e30


@dataclass(frozen=True)
class GdnShape:
    """Heads and head sizes of one GDN layer: ``Hv`` value heads share ``Hk`` key heads."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def scale(self) -> float:
        return self.key_dim**-0.5

    @property
    def id(self) -> str:
        return f"hk{self.key_heads}-hv{self.value_heads}-k{self.key_dim}-v{self.value_dim}"

    def pool(self, size: int, fill: float = POISON) -> torch.Tensor:
        """fp32 ``[size, Hv, K, V]`` filled with ``fill`` (poison: a kernel that reads it shows)."""
        return torch.full((size, self.value_heads, self.key_dim, self.value_dim), fill)

    def states(self, count: int, seed: int) -> torch.Tensor:
        """fp32 ``[count, Hv, K, V]`` random states, as a carried sequence has."""
        generator = torch.Generator().manual_seed(seed)
        return 0.5 * torch.randn(count, self.value_heads, self.key_dim, self.value_dim, generator=generator)


SHAPES = [
    GdnShape(key_heads=2, value_heads=2, key_dim=16, value_dim=8),  # Hv = Hk, K != V
    GdnShape(key_heads=2, value_heads=4, key_dim=8, value_dim=12),  # Hv = 2 Hk, V > K
]


@dataclass(frozen=True)
class GdnInputs:
    """One flat batch: q, k ``[N, Hk, K]`` (L2-normalised), v ``[N, Hv, V]``, g, beta ``[N, Hv]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def random(cls, shape: GdnShape, rows: int, seed: int) -> GdnInputs:
        """Decays as a Qwen layer makes them, ``g = -exp(A_log) softplus(a + dt_bias)``: from near 0 (long
        memory) to a few units below (a token that forgets almost everything)."""
        generator = torch.Generator().manual_seed(seed)

        def normal(*dims: int) -> torch.Tensor:
            return torch.randn(*dims, generator=generator)

        keyed, valued = (rows, shape.key_heads, shape.key_dim), (rows, shape.value_heads)
        a_log = 0.5 * normal(shape.value_heads)
        g = -a_log.exp() * F.softplus(normal(*valued) - 1.0)
        return cls(
            l2norm(normal(*keyed)),
            l2norm(normal(*keyed)),
            normal(*valued, shape.value_dim),
            g,
            torch.sigmoid(normal(*valued)),
        )

    @classmethod
    def concat(cls, parts: list[GdnInputs]) -> GdnInputs:
        return cls(*(torch.cat(column) for column in zip(*(part.as_tuple() for part in parts), strict=True)))

    def rows(self, rows: slice) -> GdnInputs:
        return GdnInputs(*(x[rows] for x in self.as_tuple()))

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v, self.g, self.beta


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@dataclass(frozen=True)
class Schedule:
    """A varlen batch: each sequence's length, pool slot and whether it continues its pooled state."""

    lengths: list[int]
    slots: list[int]
    carried: list[bool]

    @classmethod
    def random(cls, seed: int, sequences: int, pool_size: int, max_length: int) -> Schedule:
        generator = torch.Generator().manual_seed(seed)
        return cls(
            lengths=torch.randint(1, max_length + 1, (sequences,), generator=generator).tolist(),
            slots=torch.randperm(pool_size, generator=generator)[:sequences].tolist(),
            carried=(torch.rand(sequences, generator=generator) < 0.5).tolist(),
        )

    def bounds(self) -> list[int]:
        return cu_seqlens(self.lengths).tolist()

    def arguments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(cu_seqlens, slots, has_initial_state)`` as the prefill kernels take them."""
        return cu_seqlens(self.lengths), torch.tensor(self.slots), torch.tensor(self.carried)
