"""Multi-head Latent Attention over a block-paged latent cache, in the absorbed form (no RoPE).

Each cached token is one latent row of ``C + R`` values: ``C`` normalised KV latents ``c_t`` and ``R``
shared key values ``r_t`` (Kimi Linear's "rope" part, which carries no rotation). Position ``p`` of a
sequence lives at ``kv_cache[block_table[p // block_size], p % block_size]``.

Absorbed attention never expands per-head keys and values: the per-head key projection ``w_uk`` is
folded into the query, the value projection ``w_uv`` into the output,

    score_t = (q_nope w_uk . c_t + q_rope . r_t) * scale,    o = w_uv (sum_t softmax(score)_t c_t),

which equals attention with ``k_t = [w_uk c_t, r_t]`` and ``v_t = w_uv c_t``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from metrale.worker.kernels.products import einsum, heads_product

SingleRowsAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
"""``(q_latent, q_rope, kv_cache, block_tables, context_lens, scale) -> out_latent``: the attention of
sequences with one query row each (``_attend_single_rows``'s contract)."""
SequenceRowsAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
"""``(q_latent, q_rope, kv_cache, block_table, context_len, scale) -> out_latent``: one sequence's prefill
chunk (``_attend_sequence_rows``'s contract)."""


def store_latents(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token latents into the paged cache in place.

    Args:
        kv_cache: contiguous ``[num_blocks, block_size, C + R]``.
        latents: ``[N, C + R]``.
        slot_mapping: int64 ``[N]``, ``block_id * block_size + offset`` of each row, distinct.
    """
    flat_cache = kv_cache.view(-1, kv_cache.shape[-1])
    flat_cache.index_copy_(0, slot_mapping, latents.to(kv_cache.dtype))


def _gather_latents(kv_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Latent rows ``[G, L, C+R]`` at ``positions [G, L]`` of sequences paged by ``block_tables [G, *]``."""
    block_size = kv_cache.shape[1]
    blocks = torch.gather(block_tables, 1, positions // block_size)
    flat_index = blocks * block_size + positions % block_size
    return kv_cache.view(-1, kv_cache.shape[-1])[flat_index]


def _attend_latents(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latents: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    product: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] = einsum,
) -> torch.Tensor:
    """Softmax attention of queries over latent rows, output still in latent space.

    Args:
        q_latent: ``[G, M, H, C]`` queries with ``w_uk`` absorbed.
        q_rope: ``[G, M, H, R]``.
        latents: ``[G, L, C + R]``.
        visible: bool ``[G, M, L]``, at least one True per query.
        scale: score multiplier.
        product: the einsum of two operands (``products.einsum``: bf16 widened on CPUs without bf16
            instructions; ``torch.einsum`` in the compiled decode step, where inductor's loops do better).

    Returns:
        ``[G, M, H, C]`` = softmax-weighted sum of ``c_t``, in ``q_latent.dtype``.
    """
    kv_rank = q_latent.shape[-1]
    compressed, shared_key = latents[..., :kv_rank], latents[..., kv_rank:]
    scores = product("gmhc,glc->gmhl", q_latent, compressed)
    scores = (scores + product("gmhr,glr->gmhl", q_rope, shared_key)) * scale
    scores = scores.float().masked_fill(~visible.unsqueeze(2), float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(compressed.dtype)
    return product("gmhl,glc->gmhc", weights, compressed).to(q_latent.dtype)


def _attend_single_rows(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode: one query row per sequence (``[B, H, *]``), padded to the longest context, batched."""
    longest = int(context_lens.max())
    positions = torch.arange(longest, device=context_lens.device).expand(len(context_lens), -1)
    visible = positions < context_lens.unsqueeze(1)  # [B, L]
    # Padding reads position 0, which every sequence has; its weight is zero.
    latents = _gather_latents(kv_cache, block_tables, positions.where(visible, 0))
    out = _attend_latents(q_latent.unsqueeze(1), q_rope.unsqueeze(1), latents, visible.unsqueeze(1), scale)
    return out.squeeze(1)


def _attend_sequence_rows(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Prefill: the last ``M`` positions of one sequence (``[M, H, *]``) attend causally to its cache."""
    num_rows = q_latent.shape[0]
    positions = torch.arange(context_len, device=block_table.device)
    row_positions = positions[context_len - num_rows :]
    visible = positions.unsqueeze(0) <= row_positions.unsqueeze(1)  # [M, L]
    latents = _gather_latents(kv_cache, block_table.unsqueeze(0), positions.unsqueeze(0))
    out = _attend_latents(q_latent.unsqueeze(0), q_rope.unsqueeze(0), latents, visible.unsqueeze(0), scale)
    return out.squeeze(0)


def paged_mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    attend_single_rows: SingleRowsAttention | None = None,
    attend_sequence_rows: SequenceRowsAttention | None = None,
) -> torch.Tensor:
    """Causal absorbed MLA for a flat batch mixing decode rows and prefill chunks.

    This step's latents must already be stored (``store_latents``). Sequences with one row are
    attended in one batched call (``attend_single_rows``, by default the plain ``_attend_single_rows``);
    longer chunks one sequence at a time (``attend_sequence_rows``, by default the plain
    ``_attend_sequence_rows``).

    Args:
        q_nope: ``[N, H, Dn]``; sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``, which are
            its last ``len_s`` positions.
        q_rope: ``[N, H, R]``.
        kv_cache: contiguous ``[num_blocks, block_size, C + R]``.
        block_tables: int64 ``[S, max_blocks]``; entries past a sequence's last block are not read.
        cu_seqlens: int64 ``[S+1]``, every length >= 1.
        context_lens: int64 ``[S]``, cached tokens of each sequence including this step's rows.
        w_uk: ``[H, Dn, C]`` key up-projection (``kv_b_proj.weight`` viewed ``[H, Dn+Dv, C]``, first Dn).
        w_uv: ``[H, Dv, C]`` value up-projection (the last Dv of the same view).
        scale: score multiplier.
        attend_single_rows: a twin of ``_attend_single_rows`` (the C kernel's, ``kernels.native.mla``).
        attend_sequence_rows: a twin of ``_attend_sequence_rows`` (the tiled one,
            ``kernels.tiled_prefill.mla_sequence_rows``).

    Returns:
        ``o [N, H, Dv]`` in ``q_nope.dtype``.
    """
    attend_single_rows = attend_single_rows or _attend_single_rows
    attend_sequence_rows = attend_sequence_rows or _attend_sequence_rows
    q_latent = heads_product(q_nope, w_uk)  # einsum("nhd,hdc->nhc"), each row in its kind's order
    out_latent = torch.empty_like(q_latent)
    starts, lengths = cu_seqlens[:-1], cu_seqlens.diff()
    single = lengths == 1
    if bool(single.any()):
        rows = starts[single]
        out_latent[rows] = attend_single_rows(
            q_latent[rows], q_rope[rows], kv_cache, block_tables[single], context_lens[single], scale
        )
    bounds, context = cu_seqlens.tolist(), context_lens.tolist()
    for s in torch.nonzero(~single).flatten().tolist():
        rows_s = slice(bounds[s], bounds[s + 1])
        out_latent[rows_s] = attend_sequence_rows(
            q_latent[rows_s], q_rope[rows_s], kv_cache, block_tables[s], context[s], scale
        )
    return heads_product(out_latent, w_uv.transpose(1, 2)).to(q_nope.dtype)


def paged_mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    attend_single_rows: SingleRowsAttention | None = None,
) -> torch.Tensor:
    """``paged_mla_attention`` for decode rows (one query row per sequence) in shapes fixed by the inputs'
    and without reading any tensor on the host — what a compiled (or CUDA-graph) step can hold. In torch
    (the plain form): every position the block tables cover is scored, those past a sequence's context
    masked. ``attend_single_rows`` given (the C kernel as a graph op, ``metrale_native::mla_decode_latent``):
    the attention in latent space is that opaque call, which reads each row's own context in place, the
    absorbed projections stay in the graph. Equal to the reference to rounding (tested).

    Args:
        q_nope: ``[B, H, Dn]``; q_rope: ``[B, H, R]``.
        kv_cache: contiguous ``[num_blocks, block_size, C + R]``.
        block_tables: int64 ``[B, W]``, valid block ids throughout (padded with any, e.g. 0).
        context_lens: int64 ``[B]``, cached tokens including this row's; 0 for a padding row (always the
            last rows), whose output is meaningless but finite (zeros through ``attend_single_rows``).
        w_uk: ``[H, Dn, C]``; w_uv: ``[H, Dv, C]``.
        attend_single_rows: ``_attend_single_rows``' contract, padding rows allowed.

    Returns:
        ``o [B, H, Dv]`` in ``q_nope.dtype``.
    """
    q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
    if attend_single_rows is not None:
        out_latent = attend_single_rows(q_latent, q_rope, kv_cache, block_tables, context_lens, scale)
        return torch.einsum("nhc,hdc->nhd", out_latent, w_uv).to(q_nope.dtype)
    batch, width = block_tables.shape
    block_size = kv_cache.shape[1]
    positions = torch.arange(width * block_size, device=block_tables.device)
    visible = positions < context_lens.clamp(min=1).unsqueeze(1)  # [B, L]
    latents = kv_cache[block_tables].view(batch, width * block_size, kv_cache.shape[-1])
    out_latent = _attend_latents(
        q_latent.unsqueeze(1), q_rope.unsqueeze(1), latents, visible.unsqueeze(1), scale, torch.einsum
    )
    return torch.einsum("nhc,hdc->nhd", out_latent.squeeze(1), w_uv).to(q_nope.dtype)


def paged_mla_attention_one_row(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    attend_single_rows: SingleRowsAttention | None = None,
) -> torch.Tensor:
    """``paged_mla_attention``'s arguments for one row (``q_nope [1, H, Dn]``): ``mla_decode_one_row``."""
    context_len = int(context_lens[0])
    return mla_decode_one_row(
        q_nope, q_rope, kv_cache, block_tables[0], context_len, w_uk, w_uv, scale, attend_single_rows
    )


def mla_decode_one_row(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    attend_single_rows: SingleRowsAttention | None = None,
) -> torch.Tensor:
    """``paged_mla_attention`` for one decode row (one stream's step): same contract, one sequence.

    The absorbed projections are one-row matrix products per head. The attention in latent space is
    ``attend_single_rows`` where given (the C kernel, ``kernels.native.mla``: the latents read in place
    through the block table, the context split over the threads; the same kernel, so the same bits, as
    the sequence's row in a batch). Otherwise it is torch's: the sequence's latents are read in place
    when its blocks are consecutive (a view of the cache, as an allocator that hands out blocks in order
    gives one stream), else gathered block by block; every position is visible, so nothing is masked.
    Matrix products instead of einsums: equal to the reference to rounding (tested), not bitwise.

    Args:
        q_nope: ``[1, H, Dn]``; q_rope: ``[1, H, R]``.
        kv_cache: contiguous ``[num_blocks, block_size, C + R]``.
        block_table: int64 ``[max_blocks]``, the sequence's blocks first.
        context_len: cached tokens including this row's (>= 1).
        w_uk: ``[H, Dn, C]``; w_uv: ``[H, Dv, C]``.
        attend_single_rows: a twin of ``_attend_single_rows`` reading the cache through block tables.

    Returns:
        ``o [1, H, Dv]`` in ``q_nope.dtype``.
    """
    if attend_single_rows is not None:
        q_latent = heads_product(q_nope, w_uk)  # [1, H, C]
        lengths = torch.tensor([context_len], device=block_table.device)
        out_latent = attend_single_rows(q_latent, q_rope, kv_cache, block_table.unsqueeze(0), lengths, scale)
        return heads_product(out_latent, w_uv.transpose(1, 2)).to(q_nope.dtype)
    kv_rank = w_uk.shape[-1]
    latents = _sequence_latents(kv_cache, block_table, context_len)  # [L, C + R]
    compressed, shared_key = latents[:, :kv_rank], latents[:, kv_rank:]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).squeeze(1)  # [H, C]
    scores = (q_latent @ compressed.T + q_rope[0] @ shared_key.T) * scale  # [H, L]
    weights = torch.softmax(scores.float(), dim=-1).to(compressed.dtype)
    out_latent = (weights @ compressed).to(q_latent.dtype)  # [H, C]
    return torch.bmm(out_latent.unsqueeze(1), w_uv.transpose(1, 2)).transpose(0, 1).to(q_nope.dtype)


def _sequence_latents(kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` latent rows ``[L, C + R]`` of one sequence: a view of the cache when its
    blocks are consecutive, else a gathered copy."""
    block_size = kv_cache.shape[1]
    blocks = block_table[: -(-context_len // block_size)].tolist()
    first = blocks[0]
    if blocks == list(range(first, first + len(blocks))):
        held = kv_cache[first : first + len(blocks)]
    else:
        held = kv_cache[block_table[: len(blocks)]]
    return held.view(-1, kv_cache.shape[-1])[:context_len]
