"""Chunk-parallel Gated DeltaNet prefill over a varlen batch, states read from and written back to the pool.

The twin of ``metrale.worker.kernels.gdn.chunked.gdn_chunked_prefill`` (same contract; ``kda/chunked.py``
derives the chunk algebra). KDA's chunked kernel structure with a scalar decay per head: one program
owns one ``[K, BLOCK_V]`` tile of one value head's state of one sequence, keeps it in registers and walks
the sequence a chunk of ``L`` tokens at a time. With ``G`` the chunk's cumulative log-decays ``[L]``,
``D[t, j] = exp(G_t - G_j)`` (j <= t, else 0) factors out of the key sums, so both mixings are one
``tl.dot`` each (KDA builds them a column at a time from ``[L, K]`` decays):

    A        = beta * (k k^T ⊙ D)  strictly lower          Q = q k^T ⊙ D  lower
    T        = (I + A)^-1                                  forward substitution on [L, L]
    u        = T (beta v) - T (beta exp(G) k) S            delta-rule corrections [L, BLOCK_V]
    o        = (exp(G) q) S + Q u
    S       <- exp(G_last) S + (exp(G_last - G) k)^T u

Every ``exp`` argument is <= 0 (Gated DeltaNet's log-decays are <= 0).
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
)

DEFAULT_CHUNK = 64
MAX_BLOCK_V = 64
NUM_WARPS = 8
"""A program holds a ``[K, BLOCK_V]`` state, ``[L, K]`` q and k and ``[L, L]`` mixings: eight warps keep
them in registers at K = 128 (a guess: untuned, no GPU has run this yet). The chunk is longer than KDA's
32: no ``[L, K]`` decay tiles to build, so a chunk's cost grows more slowly with ``L``."""


@triton.jit
def _gdn_chunked_kernel(
    q_ptr,  # [N, Hk, K]
    k_ptr,  # [N, Hk, K]
    v_ptr,  # [N, Hv, V]
    g_ptr,  # [N, Hv]
    beta_ptr,  # [N, Hv]
    cu_seqlens_ptr,  # int64 [S + 1]
    pool_ptr,  # fp32 [P, Hv, K, V], contiguous
    slots_ptr,  # int64 [S]
    carried_ptr,  # int32 [S], 1 where the sequence continues its pooled state
    o_ptr,  # fp32 [N, Hv, V]
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq, head, value_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1)
    key_head = head // (HV // HK)
    keys = tl.arange(0, BLOCK_K)
    values = value_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok, value_ok = keys < K, values < V
    chunk_rows = tl.arange(0, CHUNK)
    causal = chunk_rows[:, None] >= chunk_rows[None, :]

    slot, carried = tl.load(slots_ptr + seq), tl.load(carried_ptr + seq)
    state_ptrs = pool_ptr + (slot * HV + head) * K * V + keys[:, None] * V + values[None, :]
    # A fresh sequence never reads its pool row, which may hold anything (its bound K * carried is 0).
    state = tl.load(state_ptrs, mask=(keys[:, None] < K * carried) & value_ok[None, :], other=0.0).to(tl.float32)

    for chunk in range(0, tl.cdiv(eos - bos, CHUNK)):
        tokens = bos + chunk * CHUNK + chunk_rows
        token_ok = tokens < eos
        # Padding rows load as k = q = v = beta = g = 0: they mix nothing, decay nothing, are not stored.
        key_offsets = (tokens[:, None] * HK + key_head) * K + keys[None, :]
        key_offsets_ok = token_ok[:, None] & key_ok[None, :]
        q = tl.load(q_ptr + key_offsets, mask=key_offsets_ok, other=0.0).to(tl.float32) * scale
        k = tl.load(k_ptr + key_offsets, mask=key_offsets_ok, other=0.0).to(tl.float32)
        value_offsets = (tokens[:, None] * HV + head) * V + values[None, :]
        value_offsets_ok = token_ok[:, None] & value_ok[None, :]
        v = tl.load(v_ptr + value_offsets, mask=value_offsets_ok, other=0.0).to(tl.float32)
        head_rows = tokens * HV + head
        cumulative_g = tl.cumsum(tl.load(g_ptr + head_rows, mask=token_ok, other=0.0).to(tl.float32), 0)
        beta = tl.load(beta_ptr + head_rows, mask=token_ok, other=0.0).to(tl.float32)

        pair_decay = tl.exp(tl.where(causal, cumulative_g[:, None] - cumulative_g[None, :], float("-inf")))
        key_key = tl.dot(k, tl.trans(k), input_precision="ieee")
        key_mixing = tl.where(chunk_rows[:, None] > chunk_rows[None, :], key_key * pair_decay, 0.0)
        query_key = tl.dot(q, tl.trans(k), input_precision="ieee") * pair_decay
        solve = invert_unit_lower(key_mixing * beta[:, None], CHUNK)
        decay_from_start = tl.exp(cumulative_g)
        values_part = tl.dot(solve, v * beta[:, None], input_precision="ieee")
        keys_part = tl.dot(solve, k * (decay_from_start * beta)[:, None], input_precision="ieee")
        corrections = values_part - tl.dot(keys_part, state, input_precision="ieee")

        o = tl.dot(q * decay_from_start[:, None], state, input_precision="ieee")
        o += tl.dot(query_key, corrections, input_precision="ieee")
        tl.store(o_ptr + value_offsets, o, mask=value_offsets_ok)

        total_g = tl.sum(tl.where(chunk_rows == CHUNK - 1, cumulative_g, 0.0), 0)
        decay_to_end = tl.exp(total_g - cumulative_g)
        state = state * tl.exp(total_g)
        state += tl.dot(tl.trans(k * decay_to_end[:, None]), corrections, input_precision="ieee")

    tl.store(state_ptrs, state, mask=key_ok[:, None] & value_ok[None, :])


def gdn_chunked_prefill(
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
    """Gated DeltaNet over a flat batch of sequence chunks; the contract of
    ``kernels.gdn.chunked.gdn_chunked_prefill``.

    Args:
        q, k: ``[N, Hk, K]``, L2-normalised by the caller; v: ``[N, Hv, V]``, ``Hv`` a multiple of
            ``Hk``; g, beta: ``[N, Hv]``. Sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``.
        cu_seqlens: int64 ``[S+1]``, every length >= 1.
        state_pool: fp32 contiguous ``[P, Hv, K, V]``; ``state_pool[slots[s]]`` is the state entering
            sequence ``s`` and is overwritten in place with the state after it. Other rows are neither
            read nor written.
        slots: int64 ``[S]``, distinct.
        has_initial_state: bool ``[S]``; False starts from zero without reading the pool row.
        scale: query multiplier.
        chunk_size: tokens per chunk, a power of two >= 16 (the smallest ``tl.dot`` tile).

    Returns:
        ``o [N, Hv, V]`` fp32.
    """
    ensure_launchable(_gdn_chunked_kernel, q)
    ensure_contiguous(state_pool, "state_pool")
    if chunk_size < MIN_DOT_TILE or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {MIN_DOT_TILE}, got {chunk_size}")
    rows, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[2]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    o = torch.empty(rows, value_heads, value_dim, dtype=torch.float32, device=q.device)
    num_seqs = slots.shape[0]
    if num_seqs == 0:
        return o
    block_v = block_size(value_dim, minimum=MIN_DOT_TILE, maximum=MAX_BLOCK_V)
    grid = (num_seqs, value_heads, triton.cdiv(value_dim, block_v))
    _gdn_chunked_kernel[grid](
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
        HK=key_heads,
        HV=value_heads,
        K=key_dim,
        V=value_dim,
        CHUNK=chunk_size,
        BLOCK_K=block_size(key_dim, minimum=MIN_DOT_TILE),
        BLOCK_V=block_v,
        num_warps=NUM_WARPS,
    )
    return o
