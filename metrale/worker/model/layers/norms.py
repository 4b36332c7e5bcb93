"""The RMS norms of the families: Kimi's (``weight · x̂``) and Qwen's zero-centred one (``(1 + w) · x̂``),
plus the Gated DeltaNet's output norm gated by ``silu(z)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.worker.kernels.ops import rms_norm
from metrale.worker.kernels.pointwise import row_invariant


class RMSNorm(nn.Module):
    """``weight · x / rms(x)`` (``kernels.norm.rms_norm``: the normalised value is rounded to ``x.dtype``
    before the weight multiplies it, as transformers' ``KimiLinearRMSNorm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(nn.Module):
    """``(1 + weight) · x / rms(x)``, all in fp32 and rounded once to ``x.dtype`` (transformers'
    ``Qwen3_5RMSNorm``; the stored weight is centred on zero)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., D]`` → ``[..., D]`` in ``x.dtype``."""
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float() + 1.0, self.eps).to(x.dtype)


def silu_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / rms(x) · silu(gate)`` over the last dimension, in fp32 (transformers'
    ``Qwen3_5RMSNormGated`` on the fp32 output of the recurrence; its weight is *not* zero-centred).

    Args:
        x, gate: ``[..., D]``.
        weight: ``[D]``.

    Returns:
        ``[..., D]`` fp32.
    """
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight.float() * normed * row_invariant(F.silu, gate.float())
