"""The C latent attention for decode rows (``mla_decode.c``): one query row per sequence, each sequence's
latents read in place from the paged cache (no gather, no padding to the longest context), its context
split into fixed spans of positions that the threads share (one long sequence uses every core).

Contract: ``kernels.mla._attend_single_rows`` (the plain twin), which ``kernels.mla.paged_mla_attention``
calls for its one-row sequences; equal to it to rounding (an online softmax, all in fp32), and a
sequence's output is the same whatever else is in the batch.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.layouts import paged_cache_fits
from metrale.worker.kernels.native.library import native_library


def supports(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> bool:
    """Whether the C kernel can run this call (CPU, an fp32 or bf16 contiguous cache, int64 block tables
    with unit-stride rows, built library)."""
    return paged_cache_fits(kv_cache, block_tables) and native_library() is not None


def attend_single_rows(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of one query row per sequence over its cached latents, output in latent space.

    Args:
        q_latent: ``[B, H, C]`` queries with ``w_uk`` absorbed.
        q_rope: ``[B, H, R]``.
        kv_cache: contiguous ``[num_blocks, block_size, C + R]``, fp32 or bf16 (see ``supports``).
        block_tables: int64 ``[B, max_blocks]``; entries past a sequence's last block are not read.
        context_lens: int64 ``[B]``, each >= 1: the positions each row attends to.
        scale: score multiplier.

    Returns:
        ``[B, H, C]`` = softmax-weighted sum of ``c_t``, in ``q_latent.dtype``.
    """
    library = native_library()
    assert library is not None, "call supports() first"
    batch, heads, kv_rank = q_latent.shape
    query = torch.cat([q_latent, q_rope], dim=-1).float().contiguous()
    lengths = context_lens.to(torch.int64).contiguous()
    out = torch.empty(batch, heads, kv_rank, dtype=torch.float32)
    decode = library.met_mla_decode_bf16 if kv_cache.dtype == torch.bfloat16 else library.met_mla_decode_f32
    status = decode(
        query.data_ptr(),
        kv_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        lengths.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_rank,
        q_rope.shape[-1],
        kv_cache.shape[1],
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"the MLA decode kernel could not allocate its partial sums ({batch} sequences)")
    return out.to(q_latent.dtype)
