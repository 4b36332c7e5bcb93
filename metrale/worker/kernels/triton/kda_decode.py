"""Fused KDA decode: one token for each of B sequences, each state read and written once, in place.

The twin of ``metrale.worker.kernels.kda.decode.kda_decode`` (same contract). One program owns one
``[K, BLOCK_V]`` tile of one head's state of one sequence and does, in registers,

    S <- diag(exp(g)) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

with ``q``, ``k`` L2-normalised and ``q`` scaled inside the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.worker.kernels.triton.runtime import block_size, ensure_contiguous, ensure_launchable, l2_normalize

MAX_BLOCK_V = 32
"""State columns per program: a ``[128, 32]`` fp32 tile is 16 KiB of registers over four warps."""


@triton.jit
def _kda_decode_kernel(
    q_ptr,  # [B, H, K]
    k_ptr,  # [B, H, K]
    v_ptr,  # [B, H, V]
    g_ptr,  # [B, H, K]
    beta_ptr,  # [B, H]
    pool_ptr,  # fp32 [P, H, K, V], contiguous
    slots_ptr,  # int64 [B]
    o_ptr,  # [B, H, V]
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq, head, value_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    keys = tl.arange(0, BLOCK_K)
    values = value_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok, value_ok = keys < K, values < V
    row = seq * H + head

    q = l2_normalize(tl.load(q_ptr + row * K + keys, mask=key_ok, other=0.0).to(tl.float32), 0) * scale
    k = l2_normalize(tl.load(k_ptr + row * K + keys, mask=key_ok, other=0.0).to(tl.float32), 0)
    g = tl.load(g_ptr + row * K + keys, mask=key_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * V + values, mask=value_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row).to(tl.float32)

    slot = tl.load(slots_ptr + seq)
    state_ptrs = pool_ptr + (slot * H + head) * K * V + keys[:, None] * V + values[None, :]
    tile_ok = key_ok[:, None] & value_ok[None, :]
    state = tl.load(state_ptrs, mask=tile_ok, other=0.0) * tl.exp(g)[:, None]
    delta = beta * (v - tl.sum(state * k[:, None], 0))
    state += k[:, None] * delta[None, :]
    tl.store(state_ptrs, state, mask=tile_ok)
    o = tl.sum(state * q[:, None], 0)
    tl.store(o_ptr + row * V + values, o.to(o_ptr.dtype.element_ty), mask=value_ok)


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Advance B sequences by one token each; the contract of ``kernels.kda.decode.kda_decode``.

    Args:
        q, k: ``[B, H, K]`` raw queries and keys (L2-normalised here, ``q`` times ``scale``).
        v: ``[B, H, V]``.
        g: ``[B, H, K]`` log-decay per key channel.
        beta: ``[B, H]``.
        state_pool: fp32 contiguous ``[P, H, K, V]``; rows ``slots`` are advanced in place, every
            other row is neither read nor written.
        slots: int64 ``[B]``, distinct.
        scale: query multiplier.

    Returns:
        ``o [B, H, V]`` in ``q.dtype``.
    """
    ensure_launchable(_kda_decode_kernel, q)
    ensure_contiguous(state_pool, "state_pool")
    batch, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    o = torch.empty(batch, heads, value_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return o
    block_v = block_size(value_dim, maximum=MAX_BLOCK_V)
    grid = (batch, heads, triton.cdiv(value_dim, block_v))
    _kda_decode_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        state_pool,
        slots,
        o,
        scale,
        H=heads,
        K=key_dim,
        V=value_dim,
        BLOCK_K=block_size(key_dim),
        BLOCK_V=block_v,
    )
    return o
