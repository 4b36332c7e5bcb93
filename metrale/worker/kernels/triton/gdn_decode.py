"""Fused Gated DeltaNet decode: one token for each of B sequences, each state read and written once, in place.

The twin of ``metrale.worker.kernels.gdn.decode.gdn_decode`` (same contract). A scalar-decay kernel of
its own: one program owns one ``[K, BLOCK_V]`` tile of one value head's state of one sequence, reads the
q and k of the key head it shares (value head ``j`` reads key head ``j // (Hv / Hk)``) and does, in
registers,

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T (scale q)

with ``g`` one log-decay per head and ``q``, ``k`` already L2-normalised by the caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.worker.kernels.triton.runtime import block_size, ensure_contiguous, ensure_launchable

MAX_BLOCK_V = 32
"""State columns per program: a ``[128, 32]`` fp32 tile is 16 KiB of registers over four warps."""


@triton.jit
def _gdn_decode_kernel(
    q_ptr,  # [B, Hk, K]
    k_ptr,  # [B, Hk, K]
    v_ptr,  # [B, Hv, V]
    g_ptr,  # [B, Hv]
    beta_ptr,  # [B, Hv]
    pool_ptr,  # fp32 [P, Hv, K, V], contiguous
    slots_ptr,  # int64 [B]
    o_ptr,  # fp32 [B, Hv, V]
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq, head, value_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    keys = tl.arange(0, BLOCK_K)
    values = value_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok, value_ok = keys < K, values < V
    row = seq * HV + head
    key_row = seq * HK + head // (HV // HK)

    q = tl.load(q_ptr + key_row * K + keys, mask=key_ok, other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + key_row * K + keys, mask=key_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * V + values, mask=value_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + row).to(tl.float32))
    beta = tl.load(beta_ptr + row).to(tl.float32)

    slot = tl.load(slots_ptr + seq)
    state_ptrs = pool_ptr + (slot * HV + head) * K * V + keys[:, None] * V + values[None, :]
    tile_ok = key_ok[:, None] & value_ok[None, :]
    state = tl.load(state_ptrs, mask=tile_ok, other=0.0) * decay
    delta = beta * (v - tl.sum(state * k[:, None], 0))
    state += k[:, None] * delta[None, :]
    tl.store(state_ptrs, state, mask=tile_ok)
    tl.store(o_ptr + row * V + values, tl.sum(state * q[:, None], 0), mask=value_ok)


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Advance B sequences by one token each; the contract of ``kernels.gdn.decode.gdn_decode``.

    Args:
        q, k: ``[B, Hk, K]``, L2-normalised by the caller.
        v: ``[B, Hv, V]``, ``Hv`` a multiple of ``Hk``.
        g: ``[B, Hv]`` log-decay per head.
        beta: ``[B, Hv]``.
        state_pool: fp32 contiguous ``[P, Hv, K, V]``; rows ``slots`` are advanced in place, every
            other row is neither read nor written.
        slots: int64 ``[B]``, distinct.
        scale: query multiplier.

    Returns:
        ``o [B, Hv, V]`` fp32.
    """
    ensure_launchable(_gdn_decode_kernel, q)
    ensure_contiguous(state_pool, "state_pool")
    batch, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[2]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    o = torch.empty(batch, value_heads, value_dim, dtype=torch.float32, device=q.device)
    if batch == 0:
        return o
    block_v = block_size(value_dim, maximum=MAX_BLOCK_V)
    grid = (batch, value_heads, triton.cdiv(value_dim, block_v))
    _gdn_decode_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        state_pool,
        slots,
        o,
        scale,
        HK=key_heads,
        HV=value_heads,
        K=key_dim,
        V=value_dim,
        BLOCK_K=block_size(key_dim),
        BLOCK_V=block_v,
    )
    return o
