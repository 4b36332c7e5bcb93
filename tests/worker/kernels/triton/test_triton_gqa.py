"""Triton paged GQA attention and key/value store against the torch references, under the interpreter."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import gqa, ops
from metrale.worker.kernels.triton import gqa as triton_gqa

pytestmark = pytest.mark.triton

BLOCK_SIZE, NUM_BLOCKS = 4, 48
POISON = 1e30
NOT_A_BLOCK = 10**6  # block-table padding: reading through it would fault or pull in poison
RTOL = ATOL = 1e-5


@dataclass
class PagedBatch:
    """Sequences scattered over a poisoned paged cache, with this step's query rows."""

    q: torch.Tensor  # [N, H, D]
    kv_cache: torch.Tensor  # [num_blocks, block_size, 2, Hkv, D]
    block_tables: torch.Tensor  # [S, max_blocks]
    cu_seqlens: torch.Tensor  # [S + 1]
    context_lens: torch.Tensor  # [S]

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.kv_cache, self.block_tables, self.cu_seqlens, self.context_lens


def _paged_batch(
    heads: int, kv_heads: int, dim: int, context_lens: list[int], row_counts: list[int], seed: int
) -> PagedBatch:
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(n / BLOCK_SIZE) for n in context_lens]
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    block_tables = torch.full((len(context_lens), max(blocks_needed) + 1), NOT_A_BLOCK)
    kv_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, 2, kv_heads, dim), POISON)
    for s, (length, needed) in enumerate(zip(context_lens, blocks_needed, strict=True)):
        block_tables[s, :needed] = torch.tensor([free_blocks.pop() for _ in range(needed)])
        positions = torch.arange(length)
        slots = block_tables[s, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        keys, values = (torch.randn(length, kv_heads, dim, generator=generator) for _ in range(2))
        gqa.store_kv(kv_cache, keys, values, slots)
    return PagedBatch(
        q=torch.randn(sum(row_counts), heads, dim, generator=generator),
        kv_cache=kv_cache,
        block_tables=block_tables,
        cu_seqlens=torch.tensor([0, *torch.tensor(row_counts).cumsum(0).tolist()]),
        context_lens=torch.tensor(context_lens),
    )


def _reference(batch: PagedBatch, scale: float) -> torch.Tensor:
    """The torch reference, whose decode path gathers a rectangle: its padding points at a real block."""
    tables = batch.block_tables.masked_fill(batch.block_tables == NOT_A_BLOCK, 0)
    return gqa.paged_gqa_attention(batch.q, batch.kv_cache, tables, batch.cu_seqlens, batch.context_lens, scale)


HEADS = [  # (heads, kv heads, head dim)
    pytest.param((4, 2, 16), id="gqa2-d16"),
    pytest.param((6, 2, 12), id="group3-d12-padded"),
    pytest.param((5, 1, 8), id="mqa5"),
    pytest.param((16, 4, 32), id="qwen3.5-16q4kv"),
    pytest.param((8, 2, 256), id="qwen3.5-8q2kv-d256"),
]
BATCHES = [
    pytest.param([9, 1, 45, 4], [1, 1, 1, 1], id="decode-only"),
    pytest.param([6, 37], [6, 5], id="prefill-only"),
    pytest.param([1, 9, 13, 6, 40], [1, 1, 5, 6, 1], id="mixed-decode-and-prefill"),
    pytest.param([70], [70], id="one-long-prompt-many-tiles"),
]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("context_lens", "row_counts"), BATCHES)
def test_triton_paged_gqa_attention_matches_torch(
    heads: tuple[int, int, int], context_lens: list[int], row_counts: list[int]
) -> None:
    num_heads, kv_heads, dim = heads
    batch = _paged_batch(num_heads, kv_heads, dim, context_lens, row_counts, seed=len(context_lens) + dim)

    o = triton_gqa.paged_gqa_attention(*batch.args(), dim**-0.5)

    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, _reference(batch, dim**-0.5), rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: the Triton interpreter's bf16 tl.dot is wrong"
)
def test_a_bf16_cache_matches_the_reference_to_bf16_rounding() -> None:
    batch = _paged_batch(8, 2, 16, [1, 9, 13, 20], [1, 1, 5, 1], seed=9)
    batch.q, batch.kv_cache = batch.q.bfloat16(), batch.kv_cache.bfloat16()
    expected = _reference(batch, 0.25)
    q, kv_cache, tables, cu_seqlens, context_lens = (t.cuda() for t in batch.args())

    o = triton_gqa.paged_gqa_attention(q, kv_cache, tables, cu_seqlens, context_lens, 0.25)

    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.cpu(), expected, rtol=2e-2, atol=2e-2)


def test_large_scores_stay_finite_and_match() -> None:
    batch = _paged_batch(4, 2, 16, [37, 5], [6, 1], seed=3)
    batch.q = 300 * batch.q

    o = triton_gqa.paged_gqa_attention(*batch.args(), 1.0)

    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, _reference(batch, 1.0), rtol=1e-5, atol=1e-4)


def test_triton_store_kv_writes_only_the_mapped_slots() -> None:
    cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, 2, 2, 12), POISON)
    expected = cache.clone()
    generator = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(3, 2, 12, generator=generator) for _ in range(2))
    slot_mapping = torch.tensor([7 * BLOCK_SIZE + 3, 0, 7 * BLOCK_SIZE + 1])

    triton_gqa.store_kv(cache, keys, values.transpose(0, 1).contiguous().transpose(0, 1), slot_mapping)
    gqa.store_kv(expected, keys, values, slot_mapping)

    assert torch.equal(cache, expected)


def test_ops_run_triton_for_the_store_and_the_attention_under_the_triton_backend(
    use_backend: Callable[[KernelBackend], None],
) -> None:
    batch = _paged_batch(4, 2, 16, [1, 9, 13], [1, 1, 5], seed=4)
    expected = _reference(batch, 0.25)
    use_backend(KernelBackend.TRITON)
    cache = torch.full_like(batch.kv_cache, POISON)
    rows = torch.arange(NUM_BLOCKS * BLOCK_SIZE)
    ops.store_kv(cache, batch.kv_cache.view(-1, 2, 2, 16)[:, 0], batch.kv_cache.view(-1, 2, 2, 16)[:, 1], rows)
    assert torch.equal(cache, batch.kv_cache)

    o = ops.paged_gqa_attention(batch.q, cache, batch.block_tables, batch.cu_seqlens, batch.context_lens, 0.25)

    torch.testing.assert_close(o, expected, rtol=RTOL, atol=ATOL)
