"""One KDA decode step for a batch of sequences whose states live in a slot-indexed pool."""

from __future__ import annotations

import torch

from metrale.worker.kernels.kda.naive import kda_step, prepare_queries_keys


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
    q32, k32 = prepare_queries_keys(q, k, scale)
    o, new_states = kda_step(state_pool[slots], q32, k32, v, g, beta)
    state_pool[slots] = new_states
    return o.to(q.dtype)
