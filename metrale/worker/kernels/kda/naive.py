"""The Kimi Delta Attention recurrence, one token at a time: the ground truth every KDA kernel matches.

Per head, with a state ``S [K, V]``, each token ``t`` does

    S   <- diag(exp(g_t)) S                      (per-key-channel decay, g_t <= 0 in practice)
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T    (delta rule: move S^T k_t toward v_t)
    o_t  = S^T q_t

with ``q`` and ``k`` L2-normalised and ``q`` multiplied by ``scale``. All arithmetic is fp32.
"""

from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x * x) + eps)`` over the last dimension (fla's convention, not ``F.normalize``)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_queries_keys(q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, L2-normalised ``q * scale`` and ``k``; shapes unchanged (``[..., K]``)."""
    return l2_normalize(q.float()) * scale, l2_normalize(k.float())


def kda_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for any number of independent heads, in fp32.

    Expects ``q`` and ``k`` already prepared (see ``prepare_queries_keys``).

    Args:
        state: ``[..., K, V]``.
        q, k, g: ``[..., K]``.
        v: ``[..., V]``.
        beta: ``[...]``.

    Returns:
        ``(o [..., V], new_state [..., K, V])``; ``state`` itself is not modified.
    """
    decayed = state * g.float().exp().unsqueeze(-1)
    recalled = torch.einsum("...kv,...k->...v", decayed, k)
    correction = (v.float() - recalled) * beta.float().unsqueeze(-1)
    new_state = decayed + k.unsqueeze(-1) * correction.unsqueeze(-2)
    return torch.einsum("...kv,...k->...v", new_state, q), new_state


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one sequence through the recurrence token by token.

    Args:
        q, k: ``[T, H, K]`` raw queries and keys (normalised here).
        v: ``[T, H, V]``.
        g: ``[T, H, K]`` log-decay per key channel.
        beta: ``[T, H]`` delta-rule step size.
        initial_state: ``[H, K, V]``, or None for a zero state.
        scale: query multiplier, usually ``K ** -0.5``.

    Returns:
        ``(o [T, H, V] in q.dtype, final_state [H, K, V] fp32)``.
    """
    num_heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    q32, k32 = prepare_queries_keys(q, k, scale)
    state = (
        torch.zeros(num_heads, key_dim, value_dim, dtype=torch.float32, device=q.device)
        if initial_state is None
        else initial_state.float()
    )
    o = torch.empty(q.shape[0], num_heads, value_dim, dtype=torch.float32, device=q.device)
    for t in range(q.shape[0]):
        o[t], state = kda_step(state, q32[t], k32[t], v[t], g[t], beta[t])
    return o.to(q.dtype), state
