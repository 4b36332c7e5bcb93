"""One Gated DeltaNet decode step for a batch of sequences whose states live in a slot-indexed pool.

The plain twin is ``naive.gdn_step`` (tested against this in ``tests/worker/kernels/test_gdn.py``).
With ``a = exp(g)`` a scalar per head, each state is read once for both products and updated in place:

    δ     = β (v − a kᵀS)
    o     = a qᵀS + (q·k) δ          (= qᵀ S')
    S'    = a S + k δᵀ
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.gdn.naive import prepare_queries_keys
from metrale.worker.kernels.pool_rows import PoolRows


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
    """Advance B sequences by one token each, vectorised over the batch.

    Args:
        q, k: ``[B, Hk, K]``, L2-normalised by the caller.
        v: ``[B, Hv, V]``, ``Hv`` a multiple of ``Hk`` (value head ``j`` reads key head ``j // (Hv / Hk)``).
        g: ``[B, Hv]`` log-decay per head.
        beta: ``[B, Hv]``.
        state_pool: fp32 ``[P, Hv, K, V]``; rows ``slots`` are read, advanced and written back in
            place, every other row is left untouched.
        slots: int64 ``[B]``, distinct.
        scale: query multiplier.

    Returns:
        ``o [B, Hv, V]`` fp32.
    """
    batch, value_heads, value_dim = v.shape
    key_dim = q.shape[-1]
    heads = batch * value_heads
    state = PoolRows.take(state_pool, slots)
    q32, k32 = (state.to_rows(x) for x in prepare_queries_keys(q, k, value_heads, scale))
    decay = state.to_rows(g).float().exp().reshape(heads, 1, 1)
    v32, beta32 = state.to_rows(v).float(), state.to_rows(beta).float()
    flat = state.rows.view(heads, key_dim, value_dim)
    recalled = torch.bmm(torch.stack([k32, q32], dim=-2).view(heads, 2, key_dim), flat).mul_(decay)
    delta = (v32.reshape(heads, value_dim) - recalled[:, 0]) * beta32.reshape(heads, 1)
    out = recalled[:, 1] + (q32 * k32).sum(-1).reshape(heads, 1) * delta
    flat.mul_(decay).baddbmm_(k32.reshape(heads, key_dim, 1), delta.unsqueeze(1))
    state.commit()
    return state.to_batch(out.view(batch, value_heads, value_dim))
