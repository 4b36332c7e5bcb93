"""The Gated DeltaNet recurrence, one token at a time: the ground truth every GDN kernel matches.

Per value head, with a state ``S [K, V]`` and the key head it reads (value head ``j`` reads key head
``j // (Hv / Hk)``, as transformers' ``repeat_interleave`` of q and k does), each token ``t`` does

    S   <- exp(g_t) S                            (one decay per head: g_t <= 0, a scalar)
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T    (delta rule: move S^T k_t toward v_t)
    o_t  = S^T (scale q_t)

The caller has already L2-normalised ``q`` and ``k`` (transformers' ``use_qk_l2norm_in_kernel`` is done
before these kernels, not in them). All arithmetic is fp32. This is transformers 5.23's
``torch_recurrent_gated_delta_rule`` with the scale a parameter.
"""

from __future__ import annotations

import torch


def expand_key_heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """``[..., Hk, K]`` -> ``[..., Hv, K]``: key head ``i`` serves value heads ``i*r .. i*r + r - 1``."""
    key_heads = x.shape[-2]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    return x if key_heads == value_heads else x.repeat_interleave(value_heads // key_heads, dim=-2)


def prepare_queries_keys(
    q: torch.Tensor, k: torch.Tensor, value_heads: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``q * scale`` and ``k``, each expanded to one row per value head: ``[..., Hk, K]`` -> ``[..., Hv, K]``."""
    return expand_key_heads(q.float(), value_heads) * scale, expand_key_heads(k.float(), value_heads)


def gdn_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for any number of independent heads, in fp32.

    Args:
        state: ``[..., K, V]``.
        q, k: ``[..., K]`` (prepared: expanded per value head, ``q`` scaled).
        v: ``[..., V]``.
        g: ``[...]`` log-decay of the head.
        beta: ``[...]``.

    Returns:
        ``(o [..., V], new_state [..., K, V])``; ``state`` itself is not modified.
    """
    decayed = state * g.float().exp()[..., None, None]
    recalled = torch.einsum("...kv,...k->...v", decayed, k)
    correction = (v.float() - recalled) * beta.float().unsqueeze(-1)
    new_state = decayed + k.unsqueeze(-1) * correction.unsqueeze(-2)
    return torch.einsum("...kv,...k->...v", new_state, q), new_state


def gdn_recurrent(
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
        q, k: ``[T, Hk, K]``, L2-normalised by the caller.
        v: ``[T, Hv, V]``, ``Hv`` a multiple of ``Hk``.
        g: ``[T, Hv]`` log-decay per head.
        beta: ``[T, Hv]`` delta-rule step size.
        initial_state: ``[Hv, K, V]``, or None for a zero state.
        scale: query multiplier, usually ``K ** -0.5``.

    Returns:
        ``(o [T, Hv, V] fp32, final_state [Hv, K, V] fp32)``.
    """
    value_heads, key_dim, value_dim = v.shape[1], q.shape[2], v.shape[2]
    q32, k32 = prepare_queries_keys(q, k, value_heads, scale)
    state = (
        torch.zeros(value_heads, key_dim, value_dim, dtype=torch.float32, device=q.device)
        if initial_state is None
        else initial_state.float()
    )
    o = torch.empty(q.shape[0], value_heads, value_dim, dtype=torch.float32, device=q.device)
    for t in range(q.shape[0]):
        o[t], state = gdn_step(state, q32[t], k32[t], v[t], g[t], beta[t])
    return o, state
