"""One KDA decode step for a batch of sequences whose states live in a slot-indexed pool.

The plain twin is ``naive.kda_step`` (tested against this in ``tests/worker/kernels/test_kda.py``).
This version reads each state once for both products it needs and updates it in place:

    o     = (q ⊙ e^g)ᵀ S + (q·k) δ          (= qᵀ S', without materializing e^g ⊙ S first)
    δ     = β (v − (k ⊙ e^g)ᵀ S)
    S'    = e^g ⊙ S + k δᵀ
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.kda.naive import prepare_queries_keys
from metrale.worker.kernels.pool_rows import PoolRows


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
    """Advance B sequences by one token each, vectorised over the batch.

    Args:
        q, k: ``[B, H, K]`` raw queries and keys (L2-normalised here, ``q`` times ``scale``).
        v: ``[B, H, V]``.
        g: ``[B, H, K]`` log-decay per key channel.
        beta: ``[B, H]``.
        state_pool: fp32 ``[P, H, K, V]``; rows ``slots`` are read, advanced and written back in
            place, every other row is left untouched.
        slots: int64 ``[B]``, distinct.
        scale: query multiplier.

    Returns:
        ``o [B, H, V]`` in ``q.dtype``.
    """
    b, h, key_dim = q.shape
    value_dim = v.shape[-1]
    state = PoolRows.take(state_pool, slots)
    q32, k32 = (state.to_rows(x) for x in prepare_queries_keys(q, k, scale))
    decay = state.to_rows(g).float().exp()
    v32, beta32 = state.to_rows(v).float(), state.to_rows(beta).float()
    flat = state.rows.view(b * h, key_dim, value_dim)
    recalled = torch.bmm(torch.stack([k32 * decay, q32 * decay], dim=-2).view(b * h, 2, key_dim), flat)
    delta = (v32.reshape(b * h, value_dim) - recalled[:, 0]) * beta32.reshape(b * h, 1)
    out = recalled[:, 1] + (q32 * k32).sum(-1).reshape(b * h, 1) * delta
    flat.mul_(decay.view(b * h, key_dim, 1)).baddbmm_(k32.reshape(b * h, key_dim, 1), delta.unsqueeze(1))
    state.commit()
    return state.to_batch(out.view(b, h, value_dim)).to(q.dtype)
