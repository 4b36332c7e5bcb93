"""Chunk-parallel KDA prefill: the recurrence of ``naive.py`` computed a chunk of tokens at a time.

Within a chunk of ``L`` tokens (per head; ``G_t`` = cumulative log-decay since the chunk start, so
``exp(G_t - G_j)`` is the decay from token ``j`` to token ``t``; ``S0`` = state entering the chunk)
the recurrence unrolls to

    S_t = diag(exp(G_t)) S0 + sum_{j<=t} diag(exp(G_t - G_j)) k_j u_j^T

where ``u_t`` is token ``t``'s delta-rule correction. Substituting into ``u_t = beta_t (v_t - k_t^T
diag(exp(g_t)) S_{t-1})`` gives a unit lower-triangular system

    (I + A) u = beta * v - beta * (k * exp(G)) S0,
    A[t, j] = beta_t sum_c k_tc k_jc exp(G_tc - G_jc)  for j < t, else 0

solved once per chunk for both right-hand sides (the UT transform: ``u = U - W S0``). Outputs and the
next state follow from ``u`` with matrix products; only the chunk's ``[H, L, L, K]`` pairwise decays
are ever materialised. Every ``exp`` argument is <= 0 as long as ``g <= 0``, which KDA's gate ensures.

``kda_chunked`` walks one sequence and is the reference. ``kda_chunked_prefill`` advances a whole
varlen batch together (``chunk_layout.py`` lays the chunks out, ``chunk_step.py`` runs them).
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.kda.chunk_layout import ChunkLayout
from metrale.worker.kernels.kda.chunk_step import run_chunks
from metrale.worker.kernels.kda.naive import prepare_queries_keys


def _pairwise_decay(cumulative_g: torch.Tensor) -> torch.Tensor:
    """``[H, L, K]`` cumulative log-decays -> ``[H, L, L, K]`` ``exp(G_i - G_j)`` for ``j <= i``, else 0."""
    length = cumulative_g.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=cumulative_g.device).tril()
    log_decay = cumulative_g.unsqueeze(2) - cumulative_g.unsqueeze(1)
    return log_decay.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()


def _kda_chunk(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance ``state [H, K, V]`` over one chunk, all fp32 and head-major.

    Args: ``q, k, g [H, L, K]`` (q, k prepared), ``v [H, L, V]``, ``beta [H, L]``.
    Returns: ``(o [H, L, V], new_state [H, K, V])``.
    """
    cumulative_g = g.cumsum(dim=1)
    decay = _pairwise_decay(cumulative_g)
    identity = torch.eye(q.shape[1], dtype=q.dtype, device=q.device)

    key_mixing = torch.einsum("hijc,hic,hjc->hij", decay, k, k) * beta.unsqueeze(-1)
    unit_lower = key_mixing.tril(diagonal=-1) + identity
    rhs = beta.unsqueeze(-1) * torch.cat([v, k * cumulative_g.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(unit_lower, rhs, upper=False, unitriangular=True)
    values_part, keys_part = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    corrections = values_part - keys_part @ state  # u: [H, L, V]

    query_key = torch.einsum("hijc,hic,hjc->hij", decay, q, k)  # lower triangle incl. diagonal
    o = (q * cumulative_g.exp()) @ state + query_key @ corrections

    total_g = cumulative_g[:, -1]  # [H, K]
    decay_to_end = (total_g.unsqueeze(1) - cumulative_g).exp()  # [H, L, K]
    new_state = state * total_g.exp().unsqueeze(-1) + (k * decay_to_end).transpose(1, 2) @ corrections
    return o, new_state


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through KDA, chunk by chunk; same contract as ``kda_recurrent``.

    Args:
        q, k: ``[T, H, K]`` raw queries and keys; v: ``[T, H, V]``; g: ``[T, H, K]``; beta: ``[T, H]``.
        initial_state: ``[H, K, V]`` or None for zeros.
        scale: query multiplier.
        chunk_size: tokens per chunk; the last chunk may be shorter.

    Returns:
        ``(o [T, H, V] in q.dtype, final_state [H, K, V] fp32)``.
    """
    q32, k32 = prepare_queries_keys(q, k, scale)
    heads_first = [x.transpose(0, 1) for x in (q32, k32, v.float(), g.float(), beta.float())]
    num_heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    state = (
        torch.zeros(num_heads, key_dim, value_dim, dtype=torch.float32, device=q.device)
        if initial_state is None
        else initial_state.float()
    )
    o = torch.empty(num_heads, q.shape[0], value_dim, dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        o[:, rows], state = _kda_chunk(state, *(x[:, rows] for x in heads_first))
    return o.transpose(0, 1).to(q.dtype), state


def kda_chunked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    chunk_size: int = 8,
) -> torch.Tensor:
    """KDA over a flat batch of sequence chunks, states read from and written back to a pool.

    All sequences advance together, one chunk position per step: a step is a handful of batched
    products over every sequence still running (see ``ChunkLayout``). ``kda_chunked`` is the
    one-sequence reference.

    Args:
        q, k: ``[N, H, K]``; v: ``[N, H, V]``; g: ``[N, H, K]``; beta: ``[N, H]``. Sequence ``s``
            owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``.
        cu_seqlens: int64 ``[S+1]``, every length >= 1.
        state_pool: fp32 ``[P, H, K, V]``; ``state_pool[slots[s]]`` is the state entering sequence
            ``s`` and is overwritten in place with the state after it. Other rows are untouched.
        slots: int64 ``[S]``, distinct.
        has_initial_state: bool ``[S]``; False starts from zero, ignoring the pool row (may be garbage).
        scale: query multiplier.
        chunk_size: tokens per chunk. The pairwise decays cost ``L * K`` per token and the steps number
            ``T / L``; 8 was the fastest measured on CPU at ``K = 128`` (16 was 1.3x slower).

    Returns:
        ``o [N, H, V]`` in ``q.dtype``.
    """
    layout = ChunkLayout.build(cu_seqlens, chunk_size)
    q32, k32 = prepare_queries_keys(q, k, scale)
    chunked = [layout.to_chunks(x) for x in (q32, k32, v.float(), g.float(), beta.float())]
    sorted_slots = slots[layout.order]
    states = state_pool[sorted_slots].masked_fill_(~has_initial_state[layout.order].view(-1, 1, 1, 1), 0.0)
    o = run_chunks(chunked, layout, states)
    state_pool.index_copy_(0, sorted_slots, states)
    return layout.to_rows(o).to(q.dtype)
