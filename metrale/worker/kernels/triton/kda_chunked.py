"""Chunk-parallel KDA prefill over a varlen batch, states read from and written back to the pool.

The twin of ``metrale.worker.kernels.kda.chunked.kda_chunked_prefill`` (same contract; its module
docstring derives the chunk algebra used here). One program owns one ``[K, BLOCK_V]`` tile of one
head's state of one sequence, keeps it in registers and walks the sequence a chunk of ``L`` tokens at
a time:

    A[t, j]  = beta_t sum_c k_tc k_jc exp(G_tc - G_jc)    (j < t)   pairwise decayed key mixing
    Q[t, j]  =        sum_c q_tc k_jc exp(G_tc - G_jc)    (j <= t)  pairwise decayed query-key scores
    T        = (I + A)^-1                                  forward substitution on [L, L]
    u        = T (beta v) - T (beta k exp(G)) S            delta-rule corrections [L, BLOCK_V]
    o        = (q exp(G)) S + Q u
    S       <- diag(exp(G_last)) S + (k exp(G_last - G))^T u

The pairwise decays are formed one column at a time from differences of cumulative log-decays, so no
``exp`` ever sees a positive argument (KDA's log-decays are <= 0). The products run on ``tl.dot``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.worker.kernels.triton.runtime import (
    MIN_DOT_TILE,
    block_size,
    ensure_contiguous,
    ensure_launchable,
    invert_unit_lower,
    l2_normalize,
)

DEFAULT_CHUNK = 32
MAX_BLOCK_V = 64
NUM_WARPS = 8
"""A program holds a ``[K, BLOCK_V]`` state and several ``[L, K]`` tiles: eight warps keep them in registers
at K = 128 (a guess: untuned, no GPU has run this yet)."""


@triton.jit
def _pairwise_mixing(q, k, cumulative_g, CHUNK: tl.constexpr):
    """``(A, Q)`` ``[L, L]`` for one chunk (``A`` without ``beta``, strictly lower; ``Q`` lower)."""
    rows = tl.arange(0, CHUNK)
    key_mixing = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    query_key = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for j in range(CHUNK):
        picked = rows[:, None] == j
        k_j = tl.sum(tl.where(picked, k, 0.0), 0)
        g_j = tl.sum(tl.where(picked, cumulative_g, 0.0), 0)
        causal = rows[:, None] >= j
        decayed_k_j = tl.exp(tl.where(causal, cumulative_g - g_j[None, :], float("-inf"))) * k_j[None, :]
        column = rows[None, :] == j
        key_mixing = tl.where(column & (rows[:, None] > j), tl.sum(k * decayed_k_j, 1)[:, None], key_mixing)
        query_key = tl.where(column, tl.sum(q * decayed_k_j, 1)[:, None], query_key)
    return key_mixing, query_key


@triton.jit
def _kda_chunked_kernel(
    q_ptr,  # [N, H, K]
    k_ptr,  # [N, H, K]
    v_ptr,  # [N, H, V]
    g_ptr,  # [N, H, K]
    beta_ptr,  # [N, H]
    cu_seqlens_ptr,  # int64 [S + 1]
    pool_ptr,  # fp32 [P, H, K, V], contiguous
    slots_ptr,  # int64 [S]
    carried_ptr,  # int32 [S], 1 where the sequence continues its pooled state
    o_ptr,  # [N, H, V]
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq, head, value_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1)
    keys = tl.arange(0, BLOCK_K)
    values = value_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok, value_ok = keys < K, values < V
    chunk_rows = tl.arange(0, CHUNK)

    slot, carried = tl.load(slots_ptr + seq), tl.load(carried_ptr + seq)
    state_ptrs = pool_ptr + (slot * H + head) * K * V + keys[:, None] * V + values[None, :]
    # A fresh sequence never reads its pool row, which may hold anything (its bound K * carried is 0).
    state = tl.load(state_ptrs, mask=(keys[:, None] < K * carried) & value_ok[None, :], other=0.0).to(tl.float32)

    for chunk in range(0, tl.cdiv(eos - bos, CHUNK)):
        tokens = bos + chunk * CHUNK + chunk_rows
        token_ok = tokens < eos
        # Padding rows load as k = q = v = beta = g = 0: they mix nothing, decay nothing, are not stored.
        key_offsets = (tokens[:, None] * H + head) * K + keys[None, :]
        key_offsets_ok = token_ok[:, None] & key_ok[None, :]
        q = l2_normalize(tl.load(q_ptr + key_offsets, mask=key_offsets_ok, other=0.0).to(tl.float32), 1) * scale
        k = l2_normalize(tl.load(k_ptr + key_offsets, mask=key_offsets_ok, other=0.0).to(tl.float32), 1)
        cumulative_g = tl.cumsum(tl.load(g_ptr + key_offsets, mask=key_offsets_ok, other=0.0).to(tl.float32), 0)
        value_offsets = (tokens[:, None] * H + head) * V + values[None, :]
        value_offsets_ok = token_ok[:, None] & value_ok[None, :]
        v = tl.load(v_ptr + value_offsets, mask=value_offsets_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tokens * H + head, mask=token_ok, other=0.0).to(tl.float32)

        key_mixing, query_key = _pairwise_mixing(q, k, cumulative_g, CHUNK)
        solve = invert_unit_lower(key_mixing * beta[:, None], CHUNK)
        decay_from_start = tl.exp(cumulative_g)
        values_part = tl.dot(solve, v * beta[:, None], input_precision="ieee")
        keys_part = tl.dot(solve, k * decay_from_start * beta[:, None], input_precision="ieee")
        corrections = values_part - tl.dot(keys_part, state, input_precision="ieee")

        o = tl.dot(q * decay_from_start, state, input_precision="ieee")
        o += tl.dot(query_key, corrections, input_precision="ieee")
        tl.store(o_ptr + value_offsets, o.to(o_ptr.dtype.element_ty), mask=value_offsets_ok)

        total_g = tl.sum(tl.where(chunk_rows[:, None] == CHUNK - 1, cumulative_g, 0.0), 0)
        decay_to_end = tl.exp(total_g[None, :] - cumulative_g)
        state = state * tl.exp(total_g)[:, None]
        state += tl.dot(tl.trans(k * decay_to_end), corrections, input_precision="ieee")

    tl.store(state_ptrs, state, mask=key_ok[:, None] & value_ok[None, :])


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
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """KDA over a flat batch of sequence chunks; the contract of ``kernels.kda.chunked.kda_chunked_prefill``.

    Args:
        q, k: ``[N, H, K]``; v: ``[N, H, V]``; g: ``[N, H, K]``; beta: ``[N, H]``. Sequence ``s``
            owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``.
        cu_seqlens: int64 ``[S+1]``, every length >= 1.
        state_pool: fp32 contiguous ``[P, H, K, V]``; ``state_pool[slots[s]]`` is the state entering
            sequence ``s`` and is overwritten in place with the state after it. Other rows are neither
            read nor written.
        slots: int64 ``[S]``, distinct.
        has_initial_state: bool ``[S]``; False starts from zero without reading the pool row.
        scale: query multiplier.
        chunk_size: tokens per chunk, a power of two >= 16 (the smallest ``tl.dot`` tile).

    Returns:
        ``o [N, H, V]`` in ``q.dtype``.
    """
    ensure_launchable(_kda_chunked_kernel, q)
    ensure_contiguous(state_pool, "state_pool")
    if chunk_size < MIN_DOT_TILE or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {MIN_DOT_TILE}, got {chunk_size}")
    rows, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    o = torch.empty(rows, heads, value_dim, dtype=q.dtype, device=q.device)
    num_seqs = slots.shape[0]
    if num_seqs == 0:
        return o
    block_v = block_size(value_dim, minimum=MIN_DOT_TILE, maximum=MAX_BLOCK_V)
    grid = (num_seqs, heads, triton.cdiv(value_dim, block_v))
    _kda_chunked_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        cu_seqlens,
        state_pool,
        slots,
        has_initial_state.to(torch.int32),
        o,
        scale,
        H=heads,
        K=key_dim,
        V=value_dim,
        CHUNK=chunk_size,
        BLOCK_K=block_size(key_dim, minimum=MIN_DOT_TILE),
        BLOCK_V=block_v,
        num_warps=NUM_WARPS,
    )
    return o
