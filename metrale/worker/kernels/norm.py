"""RMS normalisations of Kimi Linear: plain (layer norms, MLA latents) and gated (the KDA output)."""

from __future__ import annotations

import torch


def _normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension, computed and returned in fp32."""
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return x32 * torch.rsqrt(variance + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` and scale it by ``weight``.

    The variance is taken in fp32; the normalised value is cast back to ``x.dtype`` *before* the
    multiplication by ``weight`` (the numerics of transformers' ``KimiLinearRMSNorm``).

    Args:
        x: ``[..., D]``.
        weight: ``[D]``.
        eps: added to the mean square before the square root.

    Returns:
        ``[..., D]`` in the promoted dtype of ``x`` and ``weight``.
    """
    return weight * _normalize_fp32(x, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise ``x``, scale by ``weight`` and by ``sigmoid(gate)``, all in fp32.

    The numerics of transformers' ``KimiLinearRMSNormGated``: nothing is rounded until the final cast.

    Args:
        x: ``[..., D]``.
        gate: ``[..., D]``, the pre-sigmoid output gate.
        weight: ``[D]``.
        eps: added to the mean square before the square root.

    Returns:
        ``[..., D]`` in ``x.dtype``.
    """
    gated = weight.float() * _normalize_fp32(x, eps) * torch.sigmoid(gate.float())
    return gated.to(x.dtype)
