"""The terms of Gated DeltaNet chunks: the KDA chunk algebra with one decay per head, not per channel.

With a scalar cumulative log-decay ``G_t`` per head, the pairwise decay ``exp(G_t - G_j)`` factors out of
the key sums, so the key-key and query-key mixings are plain ``[L, K] @ [K, L]`` products scaled by an
``[L, L]`` decay matrix (KDA materialises ``[L, L, K]`` decays instead). The recurrence over chunks is
KDA's own (``kda.chunk_step.run_chunks``), fed these terms.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.kda.chunk_step import ChunkTerms, unit_lower_inverse


def gdn_chunk_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> ChunkTerms:
    """The terms of ``M`` chunks at once (head-major fp32).

    Args: ``q, k [M, H, L, K]`` (prepared: one row per value head, ``q`` scaled), ``v [M, H, L, V]``,
    ``g, beta [M, H, L]``; padding rows at the end of a chunk have ``q = k = g = beta = 0`` and leave
    the state as it is.
    """
    cumulative_g = g.cumsum(dim=2)  # [M, H, L]
    # exp(G_t - G_j): exact for j <= t; above the diagonal clamped to exp(0) and masked below.
    pair_decay = (cumulative_g.unsqueeze(3) - cumulative_g.unsqueeze(2)).clamp_max_(0.0).exp_()  # [M, H, t, j]
    key_mixing = (k @ k.transpose(2, 3)).mul_(pair_decay).mul_(beta.unsqueeze(-1)).tril_(diagonal=-1)
    query_key = (q @ k.transpose(2, 3)).mul_(pair_decay).tril_()
    decay_from_start = cumulative_g.exp().unsqueeze(-1)  # [M, H, L, 1]
    rhs = beta.unsqueeze(-1) * torch.cat([v, k * decay_from_start], dim=-1)
    solved = unit_lower_inverse(key_mixing) @ rhs
    corrections, state_keys = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    total_g = cumulative_g[:, :, -1:]  # [M, H, 1]
    return ChunkTerms(
        readers=torch.cat([q * decay_from_start - query_key @ state_keys, state_keys], dim=2),
        local_out=query_key @ corrections,
        corrections=corrections,
        keys_to_end=(k * (total_g - cumulative_g).exp().unsqueeze(-1)).transpose(2, 3),
        decay=total_g.exp().unsqueeze(-1),  # [M, H, 1, 1]
    )
