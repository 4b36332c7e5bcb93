"""RMS normalisations of Kimi Linear: plain (layer norms, MLA latents) and gated (the KDA output)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` through torch's fused ``rms_norm`` (fewer calls; the CPU's fast twin), bitwise the same
    numbers (tested): with the weight for fp32; for lower precisions the normalised fp32 value is rounded
    before the weight multiplies it, which the fused op with a weight would not do."""
    if x.dtype is torch.float32 and weight.dtype is torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def fused_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``gated_rms_norm`` through torch's fused ``rms_norm`` for fp32 ``x`` (the KDA output always is),
    bitwise the same numbers (tested); other dtypes take ``gated_rms_norm``."""
    if x.dtype is not torch.float32:
        return gated_rms_norm(x, gate, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight.float(), eps) * torch.sigmoid(gate.float())
