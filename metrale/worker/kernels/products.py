"""The model's matrix products, in the weight dtype — except bf16 on a CPU without bf16 instructions.

On such a CPU (no AVX512-BF16, no AMX: most AVX2 servers) torch multiplies bf16 matrices in a generic
loop, 3–6× slower than its fp32 product of the same shape; only a single row (a matrix-vector product)
is as fast. So there, a bf16 product of more than one row widens its operands to fp32 (exactly: a bf16
value is the top half of an fp32 one), multiplies in fp32 and rounds the result to bf16 once — what a
native bf16 product computes, summed in another order. The weights stay bf16 in memory.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

BF16_MATMUL_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""CPU flags (``/proc/cpuinfo``) under which torch multiplies bf16 natively."""


@cache
def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (read once from ``/proc/cpuinfo``; True where it
    cannot be read, leaving torch's own choice in place)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return flags is None or not BF16_MATMUL_FLAGS.isdisjoint(flags)


WIDEN_BF16 = not cpu_multiplies_bf16()
"""Whether bf16 products of more than one row run in fp32 here (a constant, so a compiled graph holds it)."""


def _widened(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // x.shape[-1] if x.dim() else 1
    return WIDEN_BF16 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and rows > 1


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``: ``x [..., K]``, ``weight [N, K]`` -> ``[..., N]`` in ``x.dtype``."""
    if _widened(x, weight):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


def bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(x, weight)``: ``x [E, M, K]``, ``weight [E, K, N]`` -> ``[E, M, N]`` in ``x.dtype``."""
    if _widened(x, weight):
        return torch.bmm(x.float(), weight.float()).to(x.dtype)
    return torch.bmm(x, weight)


def einsum(equation: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, x, y)`` of two operands, in ``x.dtype``; widened like :func:`linear` when
    both are bf16 on such a CPU (small bf16 batched products there, like MLA's per-head ones, run
    ~25x slower than widened)."""
    if _widened(x, y) and x.dtype == torch.bfloat16:
        return torch.einsum(equation, x.float(), y.float()).to(x.dtype)
    return torch.einsum(equation, x, y)
