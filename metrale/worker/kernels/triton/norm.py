"""RMS normalisations as Triton kernels: plain (layer norms, MLA latents) and gated (the KDA output).

The twins of ``metrale.worker.kernels.norm`` (same contracts and rounding points). One program
normalises one row of the last dimension; the mean square is taken in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.worker.kernels.triton.runtime import block_size, ensure_launchable


@triton.jit
def _normalize_row(x_ptr, row, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(x / rms(x))`` of row ``row`` in fp32, ``[BLOCK_D]`` (zero past ``D``)."""
    columns = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + row * D + columns, mask=columns < D, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.arange(0, BLOCK_D)
    normalized = _normalize_row(x_ptr, row, eps, D, BLOCK_D)
    # Rounded to x's dtype before the weight multiplies it (transformers' KimiLinearRMSNorm).
    normalized = normalized.to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + columns, mask=columns < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + columns, (weight * normalized).to(out_ptr.dtype.element_ty), mask=columns < D)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.arange(0, BLOCK_D)
    normalized = _normalize_row(x_ptr, row, eps, D, BLOCK_D)
    gate = tl.load(gate_ptr + row * D + columns, mask=columns < D, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + columns, mask=columns < D, other=0.0).to(tl.float32)
    gated = weight * normalized * tl.sigmoid(gate)
    tl.store(out_ptr + row * D + columns, gated.to(out_ptr.dtype.element_ty), mask=columns < D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` and scale by ``weight``; the contract of
    ``kernels.norm.rms_norm``.

    Args:
        x: ``[..., D]``.
        weight: ``[D]``.
        eps: added to the mean square before the square root.

    Returns:
        ``[..., D]`` in the promoted dtype of ``x`` and ``weight``.
    """
    ensure_launchable(_rms_norm_kernel, x)
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0] > 0:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, eps, D=dim, BLOCK_D=block_size(dim))
    return out.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise ``x``, scale by ``weight`` and ``sigmoid(gate)`` in fp32; the contract of
    ``kernels.norm.gated_rms_norm``.

    Args:
        x: ``[..., D]``.
        gate: ``[..., D]``, the pre-sigmoid output gate.
        weight: ``[D]``.
        eps: added to the mean square before the square root.

    Returns:
        ``[..., D]`` in ``x.dtype``.
    """
    ensure_launchable(_gated_rms_norm_kernel, x)
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0] > 0:
        gates = gate.reshape(-1, dim).contiguous()
        _gated_rms_norm_kernel[(rows.shape[0],)](rows, gates, weight, out, eps, D=dim, BLOCK_D=block_size(dim))
    return out.view(x.shape)
