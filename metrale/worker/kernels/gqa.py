"""Grouped-query attention over a block-paged key/value cache (the torch reference).

Each cached token holds its keys and values, ``[2, Hkv, D]``: position ``p`` of a sequence lives at
``kv_cache[block_table[p // block_size], p % block_size]``. Query head ``h`` attends with key/value head
``h // (H // Hkv)`` (transformers' ``repeat_kv``). Scores and the softmax are fp32; the weighted sum of
values runs in the cache dtype, as transformers' eager attention does.

The fast twins: ``kernels.native.gqa`` (C, the decode rows of a CPU batch) and ``kernels.triton.gqa``
(every row, on CUDA); ``kernels.ops`` chooses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SingleRowsAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``(q, kv_cache, block_tables, context_lens, scale) -> out``: the attention of sequences with one query
row each (``attend_single_rows``'s contract)."""
SequenceRowsAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
"""``(q, kv_cache, block_table, context_len, scale) -> out``: one sequence's prefill chunk
(``_attend_sequence_rows``'s contract)."""


def store_kv(kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each row's keys and values into the paged cache in place.

    Args:
        kv_cache: contiguous ``[num_blocks, block_size, 2, Hkv, D]``.
        keys, values: ``[N, Hkv, D]``.
        slot_mapping: int64 ``[N]``, ``block_id * block_size + offset`` of each row, distinct.
    """
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    flat.index_copy_(0, slot_mapping, torch.stack([keys, values], dim=1).to(kv_cache.dtype))


def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Cached rows ``[G, L, 2, Hkv, D]`` at ``positions [G, L]`` of sequences paged by ``block_tables [G, *]``."""
    block_size = kv_cache.shape[1]
    blocks = torch.gather(block_tables, 1, positions // block_size)
    return kv_cache.view(-1, *kv_cache.shape[2:])[blocks * block_size + positions % block_size]


def _attend(q: torch.Tensor, cached: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q [G, M, H, D]`` over ``cached [G, L, 2, Hkv, D]`` where ``visible [G, M, L]``
    (at least one True per query); ``[G, M, H, D]`` in ``q.dtype``."""
    groups = q.shape[2] // cached.shape[3]
    keys = cached[:, :, 0].repeat_interleave(groups, dim=2)  # [G, L, H, D]
    values = cached[:, :, 1].repeat_interleave(groups, dim=2)
    scores = torch.einsum("gmhd,glhd->ghml", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.einsum("ghml,glhd->gmhd", weights, values).to(q.dtype)


def attend_single_rows(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode: one query row per sequence attends to its whole context, padded to the longest, batched.

    Args:
        q: ``[B, H, D]``, row ``b`` at position ``context_lens[b] - 1``.
        kv_cache: ``[num_blocks, block_size, 2, Hkv, D]``.
        block_tables: int64 ``[B, max_blocks]``, valid block ids up to the longest context's blocks.
        context_lens: int64 ``[B]``, each >= 1.
        scale: score multiplier.

    Returns:
        ``[B, H, D]`` in ``q.dtype``.
    """
    longest = int(context_lens.max())
    positions = torch.arange(longest, device=q.device).expand(len(context_lens), -1)
    visible = positions < context_lens.unsqueeze(1)
    cached = _gather(kv_cache, block_tables, positions.where(visible, 0))  # padding reads position 0
    return _attend(q.unsqueeze(1), cached, visible.unsqueeze(1), scale).squeeze(1)


def _attend_sequence_rows(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """Prefill: the last ``M`` positions of one sequence (``q [M, H, D]``) attend causally to its cache."""
    positions = torch.arange(context_len, device=q.device)
    rows = positions[context_len - q.shape[0] :]
    visible = positions.unsqueeze(0) <= rows.unsqueeze(1)  # [M, L]
    cached = _gather(kv_cache, block_table.unsqueeze(0), positions.unsqueeze(0))
    return _attend(q.unsqueeze(0), cached, visible.unsqueeze(0), scale).squeeze(0)


def paged_gqa_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    single_rows: SingleRowsAttention | None = None,
    sequence_rows: SequenceRowsAttention | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new rows over its whole cache (the new rows already stored).

    Sequences with one row are attended in one batched call (``single_rows``, by default the plain
    ``attend_single_rows``); longer chunks one sequence at a time (``sequence_rows``, by default the plain
    ``_attend_sequence_rows``).

    Args:
        q: ``[N, H, D]`` queries (normed and rotated); sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``,
            its last ``M_s`` positions ``context_lens[s] - M_s .. context_lens[s] - 1``.
        kv_cache: ``[num_blocks, block_size, 2, Hkv, D]``.
        block_tables: int64 ``[S, max_blocks]``.
        cu_seqlens: int64 ``[S+1]``, every length >= 1.
        context_lens: int64 ``[S]``, tokens cached per sequence after this step.
        scale: score multiplier, usually ``D ** -0.5``.
        single_rows: a twin of ``attend_single_rows`` (the C kernel's, ``kernels.native.gqa``).
        sequence_rows: a twin of ``_attend_sequence_rows`` (the tiled one,
            ``kernels.tiled_prefill.gqa_sequence_rows``).

    Returns:
        ``[N, H, D]`` in ``q.dtype``.
    """
    single_rows = single_rows or attend_single_rows
    sequence_rows = sequence_rows or _attend_sequence_rows
    if q.shape[0] == len(context_lens):  # every sequence has one row (each has at least one)
        return single_rows(q, kv_cache, block_tables, context_lens, scale)
    out = torch.empty_like(q)
    starts, single = cu_seqlens[:-1], cu_seqlens.diff() == 1
    if bool(single.any()):
        rows = starts[single]
        out[rows] = single_rows(q[rows], kv_cache, block_tables[single], context_lens[single], scale)
    bounds, context = cu_seqlens.tolist(), context_lens.tolist()
    for s in torch.nonzero(~single).flatten().tolist():
        rows_s = slice(bounds[s], bounds[s + 1])
        out[rows_s] = sequence_rows(q[rows_s], kv_cache, block_tables[s], context[s], scale)
    return out
