"""Chunk-parallel Gated DeltaNet prefill over a varlen batch, states read from and written back to a pool.

The algebra is KDA's (``kda/chunked.py`` derives it) with a per-head scalar decay; ``chunk_step.py``
computes a chunk's terms, KDA's ``ChunkLayout`` and ``run_chunks`` advance all sequences together.
The plain twin is ``naive.gdn_recurrent``; transformers 5.23's ``torch_chunk_gated_delta_rule`` is the
same computation for one padded batch.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.gdn.chunk_step import gdn_chunk_terms
from metrale.worker.kernels.gdn.naive import prepare_queries_keys
from metrale.worker.kernels.kda.chunk_layout import ChunkLayout
from metrale.worker.kernels.kda.chunk_step import run_chunks

DEFAULT_CHUNK = 32
"""Tokens per chunk. The mixings cost ``L * (K + V)`` per token and the steps number ``T / L``; unlike
KDA's ``L * K`` pairwise decays (its best chunk on CPU is 8) a longer chunk is cheap. Untuned."""


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
    """Gated DeltaNet over a flat batch of sequence chunks, states read from and written back to a pool.

    Args:
        q, k: ``[N, Hk, K]``, L2-normalised by the caller; v: ``[N, Hv, V]``, ``Hv`` a multiple of
            ``Hk``; g, beta: ``[N, Hv]``. Sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``.
        cu_seqlens: int64 ``[S+1]``, every length >= 1.
        state_pool: fp32 ``[P, Hv, K, V]``; ``state_pool[slots[s]]`` is the state entering sequence
            ``s`` and is overwritten in place with the state after it. Other rows are untouched.
        slots: int64 ``[S]``, distinct.
        has_initial_state: bool ``[S]``; False starts from zero, ignoring the pool row (may be garbage).
        scale: query multiplier.
        chunk_size: tokens per chunk.

    Returns:
        ``o [N, Hv, V]`` fp32.
    """
    layout = ChunkLayout.build(cu_seqlens, chunk_size)
    q32, k32 = prepare_queries_keys(q, k, v.shape[1], scale)
    chunked = [layout.to_chunks(x) for x in (q32, k32, v.float(), g.float(), beta.float())]
    sorted_slots = slots[layout.order]
    states = state_pool[sorted_slots].masked_fill_(~has_initial_state[layout.order].view(-1, 1, 1, 1), 0.0)
    o = run_chunks(chunked, layout, states, terms_of=gdn_chunk_terms)
    state_pool.index_copy_(0, sorted_slots, states)
    return layout.to_rows(o)
