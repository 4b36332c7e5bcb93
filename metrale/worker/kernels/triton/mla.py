"""Absorbed MLA attention over the block-paged latent cache, and the latent store, as Triton kernels.

The twins of ``metrale.worker.kernels.mla`` (same contracts; its module docstring explains the
absorbed form and the cache layout). Torch folds ``w_uk`` into the query and ``w_uv`` into the output
(two small einsums); the kernel does the part that reads the cache: for each query row, the scores
over its visible positions' ``[C + R]`` latents, an online softmax, and the weighted sum of the ``C``
compressed latents. One program serves ``BLOCK_H`` heads of one row, so each latent tile it reads is
shared by those heads. Every row attends causally: position ``p`` of a sequence sees positions
``0..p``, so a decode row sees the whole context and prefill rows are handled by the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.worker.kernels.triton.runtime import MIN_DOT_TILE, block_size, ensure_launchable, sequence_of_rows

BLOCK_POSITIONS = 32
MAX_BLOCK_H = 16
STORE_BLOCK = 256


@triton.jit
def _mla_attention_kernel(
    q_latent_ptr,  # [N, H, C]
    q_rope_ptr,  # [N, H, R]
    cache_ptr,  # [num_blocks, block_size, C + R], contiguous
    block_tables_ptr,  # int64 [S, max_blocks], contiguous
    row_seq_ptr,  # int64 [N]
    cu_seqlens_ptr,  # int64 [S + 1]
    context_lens_ptr,  # int64 [S]
    out_ptr,  # [N, H, C]
    scale,
    max_blocks,
    H: tl.constexpr,
    C: tl.constexpr,
    R: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    row, head_tile = tl.program_id(0), tl.program_id(1)
    seq = tl.load(row_seq_ptr + row)
    # Rows are the sequence's last positions: row `end - 1` is position `context_len - 1`.
    visible = tl.load(context_lens_ptr + seq) - (tl.load(cu_seqlens_ptr + seq + 1) - row) + 1
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    latent_dims, rope_dims = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    head_ok, latent_ok, rope_ok = heads < H, latent_dims < C, rope_dims < R
    cache_ty = cache_ptr.dtype.element_ty

    query_rows = (row * H + heads)[:, None]
    latent_mask, rope_mask = head_ok[:, None] & latent_ok[None, :], head_ok[:, None] & rope_ok[None, :]
    q_latent = tl.load(q_latent_ptr + query_rows * C + latent_dims[None, :], mask=latent_mask, other=0.0)
    q_rope = tl.load(q_rope_ptr + query_rows * R + rope_dims[None, :], mask=rope_mask, other=0.0)
    q_latent, q_rope = q_latent.to(cache_ty), q_rope.to(cache_ty)

    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    for start in range(0, visible, BLOCK_L):
        positions = start + tl.arange(0, BLOCK_L)
        position_ok = positions < visible  # never reads past the context: no padding block is touched
        block = tl.load(block_tables_ptr + seq * max_blocks + positions // CACHE_BLOCK, mask=position_ok, other=0)
        tokens = (block * CACHE_BLOCK + positions % CACHE_BLOCK)[:, None] * (C + R)
        latent_mask, rope_mask = position_ok[:, None] & latent_ok[None, :], position_ok[:, None] & rope_ok[None, :]
        latent = tl.load(cache_ptr + tokens + latent_dims[None, :], mask=latent_mask, other=0.0)
        rope = tl.load(cache_ptr + tokens + C + rope_dims[None, :], mask=rope_mask, other=0.0)

        scores = tl.dot(q_latent, tl.trans(latent), input_precision="ieee")
        scores = (scores + tl.dot(q_rope, tl.trans(rope), input_precision="ieee")) * scale
        scores = tl.where(position_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(cache_ty), latent, input_precision="ieee")
        running_max = new_max

    out = acc / running_sum[:, None]
    out_ptrs = out_ptr + query_rows * C + latent_dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & latent_ok[None, :])


@triton.jit
def _store_latents_kernel(
    cache_ptr,  # [num_blocks * block_size, WIDTH], contiguous
    latents_ptr,  # [N, WIDTH]
    slot_mapping_ptr,  # int64 [N]
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    column_ok = columns < WIDTH
    values = tl.load(latents_ptr + row * WIDTH + columns, mask=column_ok)
    target = tl.load(slot_mapping_ptr + row) * WIDTH + columns
    tl.store(cache_ptr + target, values.to(cache_ptr.dtype.element_ty), mask=column_ok)


def store_latents(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token latents into the paged cache in place; the contract of ``kernels.mla.store_latents``.

    Args:
        kv_cache: contiguous ``[num_blocks, block_size, C + R]``.
        latents: ``[N, C + R]``.
        slot_mapping: int64 ``[N]``, ``block_id * block_size + offset`` of each row, distinct.
    """
    ensure_launchable(_store_latents_kernel, latents)
    rows, width = latents.shape
    if rows == 0:
        return
    grid = (rows, triton.cdiv(width, STORE_BLOCK))
    _store_latents_kernel[grid](
        kv_cache, latents.contiguous(), slot_mapping, WIDTH=width, BLOCK=min(STORE_BLOCK, block_size(width))
    )


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
) -> torch.Tensor:
    """Causal absorbed MLA for a flat batch of decode rows and prefill chunks; the contract of
    ``kernels.mla.paged_mla_attention``.

    Args:
        q_nope: ``[N, H, Dn]``; sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``, its last
            positions.
        q_rope: ``[N, H, R]``.
        kv_cache: contiguous ``[num_blocks, block_size, C + R]``, this step's latents already stored.
        block_tables: int64 ``[S, max_blocks]``; entries past a sequence's last block are not read.
        cu_seqlens: int64 ``[S+1]``, every length >= 1.
        context_lens: int64 ``[S]``, cached tokens of each sequence including this step's rows.
        w_uk: ``[H, Dn, C]``; w_uv: ``[H, Dv, C]``.
        scale: score multiplier.

    Returns:
        ``o [N, H, Dv]`` in ``q_nope.dtype``.
    """
    ensure_launchable(_mla_attention_kernel, q_nope)
    rows, heads, _ = q_nope.shape
    kv_rank, rope_dim = w_uk.shape[-1], q_rope.shape[-1]
    q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk).contiguous()
    out_latent = torch.empty_like(q_latent)
    if rows > 0:
        block_h = block_size(heads, minimum=MIN_DOT_TILE, maximum=MAX_BLOCK_H)
        _mla_attention_kernel[(rows, triton.cdiv(heads, block_h))](
            q_latent,
            q_rope.contiguous(),
            kv_cache,
            block_tables.contiguous(),
            sequence_of_rows(cu_seqlens, rows),
            cu_seqlens,
            context_lens,
            out_latent,
            scale,
            block_tables.shape[1],
            H=heads,
            C=kv_rank,
            R=rope_dim,
            CACHE_BLOCK=kv_cache.shape[1],
            BLOCK_H=block_h,
            BLOCK_C=block_size(kv_rank, minimum=MIN_DOT_TILE),
            BLOCK_R=block_size(rope_dim, minimum=MIN_DOT_TILE),
            BLOCK_L=BLOCK_POSITIONS,
        )
    return torch.einsum("nhc,hdc->nhd", out_latent, w_uv).to(q_nope.dtype)
