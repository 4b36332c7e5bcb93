"""What every Triton launcher here shares: where a kernel can run, block sizes, varlen row maps."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from metrale.worker.kernels.triton import TritonUnavailableError

MIN_DOT_TILE = 16
"""Smallest tile side ``tl.dot`` accepts on NVIDIA GPUs; every dotted block dimension is padded to it."""


def ensure_launchable(kernel: object, tensor: torch.Tensor) -> None:
    """Raise unless ``kernel`` can run on ``tensor``'s device.

    A kernel decorated while ``TRITON_INTERPRET=1`` runs anywhere (on CPU tensors, through Triton's
    interpreter); a compiled one needs CUDA tensors.
    """
    if tensor.is_cuda or isinstance(kernel, InterpretedFunction):
        return
    raise TritonUnavailableError(
        "Triton kernels got CPU tensors, but they were compiled for a GPU. To run them on the CPU, set "
        "TRITON_INTERPRET=1 in the environment before triton and metrale's Triton kernels are imported; "
        "otherwise use the torch kernels (MET_KERNELS=torch or auto)."
    )


def ensure_contiguous(pool: torch.Tensor, name: str) -> None:
    """In-place pools cannot be copied into a contiguous layout, so they must already have one."""
    if not pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous to be updated in place, got strides {pool.stride()}")


def block_size(extent: int, minimum: int = 1, maximum: int | None = None) -> int:
    """The power of two covering ``extent`` (at least ``minimum``, at most ``maximum`` when given)."""
    size = max(triton.next_power_of_2(extent), minimum)
    return size if maximum is None else min(size, maximum)


def sequence_of_rows(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 ``[N]``: the sequence owning each row of a flat varlen batch, without a host sync.

    Args:
        cu_seqlens: int64 ``[S+1]`` row offsets, every length >= 1.
        num_rows: ``N`` = ``cu_seqlens[-1]``.
    """
    rows = torch.arange(num_rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], rows, right=True)


@triton.jit
def l2_normalize(x, axis: tl.constexpr):
    """``x / sqrt(sum(x * x) + 1e-6)`` along ``axis``, the convention of ``kda.naive.l2_normalize``."""
    return x / tl.sqrt(tl.sum(x * x, axis, keep_dims=True) + 1e-6)


@triton.jit
def invert_unit_lower(strictly_lower, CHUNK: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower-triangular ``A [L, L]``, by forward substitution on rows."""
    rows = tl.arange(0, CHUNK)
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for t in range(1, CHUNK):
        picked = rows[:, None] == t
        row_of_a = tl.sum(tl.where(picked, strictly_lower, 0.0), 0)
        # Rows >= t of `inverse` are still identity rows and A[t, j >= t] = 0: only solved rows count.
        combination = tl.sum(row_of_a[:, None] * inverse, 0)
        inverse = tl.where(picked, inverse - combination[None, :], inverse)
    return inverse
