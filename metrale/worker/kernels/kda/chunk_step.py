"""The batched chunk recurrence: at each step every sequence still running advances by one chunk.

The algebra is the one ``chunked.py`` derives for a single sequence, applied to ``M`` chunks (one per
sequence) at once with head-major fp32 tensors ``[M, H, L, *]``. The state-free terms of a chunk
(``ChunkTerms``) come from its own tokens only; the state then enters through two batched products.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from metrale.worker.kernels.kda.chunk_layout import ChunkLayout


@dataclass(frozen=True)
class ChunkTerms:
    """What each of ``M`` chunks contributes apart from the state ``S`` entering it (head-major, fp32).

    With ``u = corrections - readers[:, :, L:] S`` (the delta-rule corrections), a chunk's output is
    ``readers[:, :, :L] S + local_out`` and the state leaving it ``decay * S + keys_to_end u``.
    """

    readers: torch.Tensor  # [M, H, 2L, K]: (q e^G - Q W) over W, W = (I + A)^-1 beta k e^G
    local_out: torch.Tensor  # [M, H, L, V]: Q U, the output of a chunk entered with a zero state
    corrections: torch.Tensor  # [M, H, L, V]: U = (I + A)^-1 beta v
    keys_to_end: torch.Tensor  # [M, H, K, L]: (k e^(G_last - G))^T
    decay: torch.Tensor  # [M, H, K, 1] (or [M, H, 1, 1] for a per-head decay): e^G_last


def _pairwise_scores(cumulative_g: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[M, H, L, L, 2]``: at ``[t, j]`` the decayed key-key (0) and query-key (1) products.

    Entry ``[t, j, ·] = sum_c x_tc k_jc exp(G_tc - G_jc)`` with ``x = k, q``; exact for ``j <= t``,
    meaningless above the diagonal (the exponent is clamped to 0 there, so it stays finite).
    Args: ``cumulative_g, q, k [M, H, L, K]``.
    """
    log_decay = (cumulative_g.unsqueeze(3) - cumulative_g.unsqueeze(2)).clamp_max_(0.0)  # [M, H, t, j, K]
    decayed_keys = log_decay.exp_().mul_(k.unsqueeze(2))
    return decayed_keys @ torch.stack([k, q], dim=-1)  # [M, H, t, j, K] @ [M, H, t, K, 2]


def unit_lower_inverse(strictly_lower: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``A [..., L, L]``, by a few batched matrix products.

    ``A`` is nilpotent (``A^L = 0``), so ``(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...`` up to ``A^(L/2)``.
    """
    length = strictly_lower.shape[-1]
    inverse = torch.eye(length, dtype=strictly_lower.dtype, device=strictly_lower.device) - strictly_lower
    power, reached = strictly_lower, 2
    while reached < length:
        power = power @ power
        inverse = inverse + inverse @ power
        reached *= 2
    return inverse


def chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> ChunkTerms:
    """The terms of ``M`` chunks at once.

    Args: ``q, k, g [M, H, L, K]`` (q, k prepared), ``v [M, H, L, V]``, ``beta [M, H, L]``; padding
    rows at the end of a chunk have ``g = beta = 0`` and leave the state as it is.
    """
    cumulative_g = g.cumsum(dim=2)
    scores = _pairwise_scores(cumulative_g, q, k)
    key_mixing = (scores[..., 0] * beta.unsqueeze(-1)).tril_(diagonal=-1)
    query_key = scores[..., 1].tril()
    decay_from_start = cumulative_g.exp()
    rhs = beta.unsqueeze(-1) * torch.cat([v, k * decay_from_start], dim=-1)
    solved = unit_lower_inverse(key_mixing) @ rhs
    corrections, state_keys = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    total_g = cumulative_g[:, :, -1:]  # [M, H, 1, K]
    return ChunkTerms(
        readers=torch.cat([q * decay_from_start - query_key @ state_keys, state_keys], dim=2),
        local_out=query_key @ corrections,
        corrections=corrections,
        keys_to_end=(k * (total_g - cumulative_g).exp()).transpose(2, 3),
        decay=total_g.exp().transpose(2, 3),
    )


def run_chunks(
    inputs: list[torch.Tensor],
    layout: ChunkLayout,
    states: torch.Tensor,
    terms_of: Callable[..., ChunkTerms] = chunk_terms,
) -> torch.Tensor:
    """Carry ``states [S, H, K, V]`` (sorted as ``layout.order``) through every chunk, in place.

    Args: ``inputs`` = ``q, k, v, g, beta`` as chunks (``layout.to_chunks``); ``terms_of`` computes a
    step's ``ChunkTerms`` from them (KDA's per-channel decay by default; Gated DeltaNet passes its own).
    Returns: ``o [M, H, L, V]``.

    Each step's terms are computed just before it runs: the step's working set then stays in cache.
    """
    length = layout.chunk_size
    o = torch.empty_like(inputs[2])
    for first, count in layout.steps:
        chunks = slice(first, first + count)
        terms = terms_of(*(x[chunks] for x in inputs))
        running = states[:count]
        read = terms.readers @ running  # [count, H, 2L, V]
        o[chunks] = read[:, :, :length] + terms.local_out
        corrections = terms.corrections - read[:, :, length:]
        flat = running.mul_(terms.decay).flatten(0, 1)
        flat.baddbmm_(terms.keys_to_end.flatten(0, 1), corrections.flatten(0, 1))
    return o
