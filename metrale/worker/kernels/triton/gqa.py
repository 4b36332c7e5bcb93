"""Grouped-query attention over the block-paged key/value cache, and the key/value store, as Triton kernels.

The twins of ``metrale.worker.kernels.gqa`` (same contracts; its module docstring gives the cache layout).
One program serves one KV head for a tile of query rows of one sequence: the ``G = H / Hkv`` query heads
of that KV head's group for each of ``BLOCK_M`` consecutive rows, flattened into one ``[BLOCK_M · BLOCK_G, D]``
query block, so each key/value tile it reads from the cache is shared by all of them (no ``repeat_kv``
copy). Scores are an online softmax in fp32 over the positions ``BLOCK_L`` at a time; the weighted sum
of values is a dot in the cache dtype, accumulated in fp32. Every row attends causally: position ``p``
of a sequence sees positions ``0..p``, so a decode row sees the whole context.

Two launches of the one kernel: decode (every sequence has one row: one program per sequence and KV
head, no host sync) and prefill (any mix of rows: the tiles of each sequence's rows, listed on the host
after one read of ``cu_seqlens``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.worker.kernels.triton.runtime import MIN_DOT_TILE, block_size, ensure_launchable

BLOCK_POSITIONS = 32
PREFILL_QUERIES = 64
"""Query rows (row × group head pairs) per prefill program: ``BLOCK_M = PREFILL_QUERIES / BLOCK_G``."""
STORE_BLOCK = 256


@triton.jit
def _gqa_attention_kernel(
    q_ptr,  # [N, H, D], contiguous
    cache_ptr,  # [num_blocks, block_size, 2, HKV, D], contiguous
    block_tables_ptr,  # int64 [S, max_blocks], contiguous
    tile_seq_ptr,  # int64 [T]: the sequence of each tile (prefill)
    tile_row_ptr,  # int64 [T]: the first row of each tile (prefill)
    cu_seqlens_ptr,  # int64 [S + 1]
    context_lens_ptr,  # int64 [S]
    out_ptr,  # [N, H, D]
    scale,
    max_blocks,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    DECODE: tl.constexpr,
):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    if DECODE:  # row s is sequence s's only row
        seq = tile.to(tl.int64)
        first_row = seq
    else:
        seq = tl.load(tile_seq_ptr + tile)
        first_row = tl.load(tile_row_ptr + tile)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    context = tl.load(context_lens_ptr + seq)
    cache_ty = cache_ptr.dtype.element_ty

    # Query i of the block is row first_row + i // BLOCK_G, head kv_head * GROUP + i % BLOCK_G.
    index = tl.arange(0, BLOCK_M * BLOCK_G)
    rows, member = first_row + index // BLOCK_G, index % BLOCK_G
    query_ok = (rows < end) & (member < GROUP)
    heads = kv_head * GROUP + member
    # Rows are the sequence's last positions: row `end - 1` is position `context - 1`. A padding query
    # sees position 0 (every sequence has it) so that its softmax stays finite; it is never stored.
    visible = tl.where(query_ok, context - (end - rows) + 1, 1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    query_offsets = ((rows * H + heads) * D)[:, None] + dims[None, :]
    query_mask = query_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + query_offsets, mask=query_mask, other=0.0).to(cache_ty)

    running_max = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(0, tl.max(visible, 0), BLOCK_L):
        positions = start + tl.arange(0, BLOCK_L)
        position_ok = positions < context  # never reads past the context: no padding block is touched
        block = tl.load(block_tables_ptr + seq * max_blocks + positions // CACHE_BLOCK, mask=position_ok, other=0)
        token = (block * CACHE_BLOCK + positions % CACHE_BLOCK) * (2 * HKV * D)
        key_ptrs = cache_ptr + (token + kv_head * D)[:, None] + dims[None, :]
        tile_mask = position_ok[:, None] & dim_ok[None, :]
        keys = tl.load(key_ptrs, mask=tile_mask, other=0.0)
        values = tl.load(key_ptrs + HKV * D, mask=tile_mask, other=0.0)

        scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
        scores = tl.where(positions[None, :] < visible[:, None], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(cache_ty), values, input_precision="ieee")
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(out_ptr + query_offsets, out.to(out_ptr.dtype.element_ty), mask=query_mask)


@triton.jit
def _store_kv_kernel(
    cache_ptr,  # [num_blocks * block_size, 2, WIDTH], contiguous
    keys_ptr,  # [N, WIDTH], contiguous
    values_ptr,  # [N, WIDTH], contiguous
    slot_mapping_ptr,  # int64 [N]
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    column_ok = columns < WIDTH
    keys = tl.load(keys_ptr + row * WIDTH + columns, mask=column_ok)
    values = tl.load(values_ptr + row * WIDTH + columns, mask=column_ok)
    target = cache_ptr + tl.load(slot_mapping_ptr + row) * (2 * WIDTH) + columns
    tl.store(target, keys.to(cache_ptr.dtype.element_ty), mask=column_ok)
    tl.store(target + WIDTH, values.to(cache_ptr.dtype.element_ty), mask=column_ok)


def store_kv(kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each row's keys and values into the paged cache in place; the contract of
    ``kernels.gqa.store_kv``.

    Args:
        kv_cache: contiguous ``[num_blocks, block_size, 2, Hkv, D]``.
        keys, values: ``[N, Hkv, D]``.
        slot_mapping: int64 ``[N]``, ``block_id * block_size + offset`` of each row, distinct.
    """
    ensure_launchable(_store_kv_kernel, keys)
    rows = keys.shape[0]
    if rows == 0:
        return
    width = keys.shape[1] * keys.shape[2]
    grid = (rows, triton.cdiv(width, STORE_BLOCK))
    _store_kv_kernel[grid](
        kv_cache,
        keys.contiguous(),
        values.contiguous(),
        slot_mapping,
        WIDTH=width,
        BLOCK=min(STORE_BLOCK, block_size(width)),
    )


def paged_gqa_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new rows over its whole cache; the contract of
    ``kernels.gqa.paged_gqa_attention``.

    Args:
        q: ``[N, H, D]``; sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``, its last positions.
        kv_cache: contiguous ``[num_blocks, block_size, 2, Hkv, D]``, this step's keys and values stored.
        block_tables: int64 ``[S, max_blocks]``; entries past a sequence's last block are not read.
        cu_seqlens: int64 ``[S+1]``, every length >= 1.
        context_lens: int64 ``[S]``, cached tokens of each sequence including this step's rows.
        scale: score multiplier.

    Returns:
        ``[N, H, D]`` in ``q.dtype``.
    """
    ensure_launchable(_gqa_attention_kernel, q)
    rows, heads, dim = q.shape
    kv_heads = kv_cache.shape[3]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group evenly over {kv_heads} key/value heads")
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    if rows == 0:
        return out
    sequences = len(context_lens)
    decode = rows == sequences  # every sequence has at least one row, so exactly one each
    if decode:
        block_g, block_m = block_size(group, minimum=MIN_DOT_TILE), 1
        tile_seq = tile_row = cu_seqlens  # not read by the decode launch
        tiles = sequences
    else:
        block_g = block_size(group)
        block_m = max(1, PREFILL_QUERIES // block_g)
        tile_seq, tile_row = _prefill_tiles(cu_seqlens, block_m)
        tiles = len(tile_seq)
    _gqa_attention_kernel[(tiles, kv_heads)](
        q,
        kv_cache,
        block_tables.contiguous(),
        tile_seq,
        tile_row,
        cu_seqlens,
        context_lens,
        out,
        scale,
        block_tables.shape[1],
        H=heads,
        HKV=kv_heads,
        D=dim,
        GROUP=group,
        CACHE_BLOCK=kv_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        BLOCK_D=block_size(dim, minimum=MIN_DOT_TILE),
        BLOCK_L=BLOCK_POSITIONS,
        DECODE=decode,
    )
    return out


def _prefill_tiles(cu_seqlens: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``([T], [T])``: the sequence and first row of every tile of ``block_m`` consecutive rows of one
    sequence (a sequence's last tile may be short). One host read: the tile count."""
    starts, lengths = cu_seqlens[:-1], cu_seqlens.diff()
    per_sequence = (lengths + block_m - 1) // block_m
    total = int(per_sequence.sum())
    tile_seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=cu_seqlens.device), per_sequence, output_size=total
    )
    first_tile = per_sequence.cumsum(0) - per_sequence
    index_in_sequence = torch.arange(total, device=cu_seqlens.device) - first_tile[tile_seq]
    return tile_seq, starts[tile_seq] + index_in_sequence * block_m
