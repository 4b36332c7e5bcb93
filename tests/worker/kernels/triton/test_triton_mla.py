"""Triton paged MLA attention and latent store against the torch references, under the interpreter."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from metrale.worker.kernels import mla
from metrale.worker.kernels.triton import mla as triton_mla

pytestmark = pytest.mark.triton

NOPE_DIM, ROPE_DIM, VALUE_DIM, KV_RANK = 8, 4, 6, 24
BLOCK_SIZE, NUM_BLOCKS = 4, 32
POISON = 1e30
NOT_A_BLOCK = 10**6  # block-table padding: reading through it would fault or pull in poison
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@dataclass
class PagedBatch:
    """Sequences scattered over a poisoned paged cache, with this step's query rows."""

    q_nope: torch.Tensor  # [N, H, Dn]
    q_rope: torch.Tensor  # [N, H, R]
    kv_cache: torch.Tensor  # [num_blocks, block_size, C + R]
    block_tables: torch.Tensor  # [S, max_blocks]
    cu_seqlens: torch.Tensor  # [S + 1]
    context_lens: torch.Tensor  # [S]


def _paged_batch(heads: int, context_lens: list[int], row_counts: list[int], seed: int) -> PagedBatch:
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(n / BLOCK_SIZE) for n in context_lens]
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    block_tables = torch.full((len(context_lens), max(blocks_needed) + 1), NOT_A_BLOCK)
    kv_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_RANK + ROPE_DIM), POISON)
    for s, (length, needed) in enumerate(zip(context_lens, blocks_needed, strict=True)):
        block_tables[s, :needed] = torch.tensor([free_blocks.pop() for _ in range(needed)])
        positions = torch.arange(length)
        slots = block_tables[s, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        latents = torch.randn(length, KV_RANK + ROPE_DIM, generator=generator)
        mla.store_latents(kv_cache, latents, slots)
    rows = sum(row_counts)
    return PagedBatch(
        q_nope=torch.randn(rows, heads, NOPE_DIM, generator=generator),
        q_rope=torch.randn(rows, heads, ROPE_DIM, generator=generator),
        kv_cache=kv_cache,
        block_tables=block_tables,
        cu_seqlens=torch.tensor([0, *torch.tensor(row_counts).cumsum(0).tolist()]),
        context_lens=torch.tensor(context_lens),
    )


def _up_projections(heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w_uk [H, Dn, C]`` and ``w_uv [H, Dv, C]``."""
    generator = torch.Generator().manual_seed(seed)
    per_head = torch.randn(heads, NOPE_DIM + VALUE_DIM, KV_RANK, generator=generator) * KV_RANK**-0.5
    return per_head[:, :NOPE_DIM], per_head[:, NOPE_DIM:]


@pytest.mark.parametrize("heads", [pytest.param(3, id="h3"), pytest.param(20, id="h20-two-head-tiles")])
@pytest.mark.parametrize(
    ("context_lens", "row_counts"),
    [
        pytest.param([9, 1, 45, 4], [1, 1, 1, 1], id="decode-only"),
        pytest.param([6, 37], [6, 5], id="prefill-only"),
        pytest.param([1, 9, 13, 6, 40], [1, 1, 5, 6, 1], id="mixed-decode-and-prefill"),
    ],
)
def test_triton_paged_mla_attention_matches_torch(heads: int, context_lens: list[int], row_counts: list[int]) -> None:
    batch = _paged_batch(heads, context_lens, row_counts, seed=len(context_lens))
    w_uk, w_uv = _up_projections(heads, seed=1)
    args = (batch.q_nope, batch.q_rope, batch.kv_cache, batch.block_tables, batch.cu_seqlens, batch.context_lens)

    o = triton_mla.paged_mla_attention(*args, w_uk, w_uv, NOPE_DIM**-0.5)
    expected = mla.paged_mla_attention(*args, w_uk, w_uv, NOPE_DIM**-0.5)

    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, expected, **TOLERANCE)


def test_triton_store_latents_writes_only_the_mapped_slots() -> None:
    cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_RANK + ROPE_DIM), POISON)
    expected = cache.clone()
    latents = torch.randn(3, KV_RANK + ROPE_DIM, generator=torch.Generator().manual_seed(2))
    slot_mapping = torch.tensor([7 * BLOCK_SIZE + 3, 0, 7 * BLOCK_SIZE + 1])

    triton_mla.store_latents(cache, latents, slot_mapping)
    mla.store_latents(expected, latents, slot_mapping)

    assert torch.equal(cache, expected)
