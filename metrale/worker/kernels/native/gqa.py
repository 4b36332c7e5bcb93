"""The C grouped-query attention for decode rows (``gqa_decode.c``): one query row per sequence, each
sequence's keys and values read in place from the paged cache (no gather, no padding to the longest
context, no ``repeat_kv`` copy: the heads of a group share their KV head's tiles), its context split into
fixed spans of positions that the threads share (one long sequence uses every core).

Contract: ``kernels.gqa.attend_single_rows`` (the plain twin), which ``kernels.gqa.paged_gqa_attention``
calls for its one-row sequences; equal to it to rounding (an online softmax, all in fp32, where the
reference sums values in the cache dtype), and a sequence's output is the same whatever else is in the
batch and at any thread count.
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
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of one query row per sequence over its cached keys and values.

    Args:
        q: ``[B, H, D]``, ``H`` a multiple of ``Hkv``.
        kv_cache: contiguous ``[num_blocks, block_size, 2, Hkv, D]``, fp32 or bf16 (see ``supports``).
        block_tables: int64 ``[B, max_blocks]``; entries past a sequence's last block are not read.
        context_lens: int64 ``[B]``, each >= 1: the positions each row attends to.
        scale: score multiplier.

    Returns:
        ``[B, H, D]`` in ``q.dtype``.
    """
    library = native_library()
    assert library is not None, "call supports() first"
    batch, heads, dim = q.shape
    kv_heads = kv_cache.shape[3]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group evenly over {kv_heads} key/value heads")
    query = q.float().contiguous()
    lengths = context_lens.to(torch.int64).contiguous()
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    decode = library.met_gqa_decode_bf16 if kv_cache.dtype == torch.bfloat16 else library.met_gqa_decode_f32
    status = decode(
        query.data_ptr(),
        kv_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        lengths.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        kv_cache.shape[1],
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"the GQA decode kernel could not allocate its partial sums ({batch} sequences)")
    return out.to(q.dtype)
