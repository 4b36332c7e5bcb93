"""The C grouped-query attention for decode rows against its plain twin (``kernels.gqa.attend_single_rows``)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import gqa, ops
from metrale.worker.kernels.native import gqa as native_gqa

NOT_A_BLOCK = 10**6  # block-table padding past a sequence's blocks: never read


def _paged(
    context_lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of random keys and values in shuffled blocks, its block tables, and one query row per
    sequence: ``(q [B, H, D], kv_cache [num_blocks, block_size, 2, Hkv, D], block_tables, context_lens)``."""
    generator = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    kv_cache = torch.randn(num_blocks, block_size, 2, kv_heads, dim, generator=generator)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((len(context_lens), max(needed) + 1), NOT_A_BLOCK)
    for s, count in enumerate(needed):
        tables[s, :count] = torch.tensor([free.pop() for _ in range(count)])
    q = torch.randn(len(context_lens), heads, dim, generator=generator)
    return q, kv_cache, tables, torch.tensor(context_lens)


def _reference(
    q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    padding = tables == NOT_A_BLOCK  # the reference gathers a rectangle: point its padding at a real block
    return gqa.attend_single_rows(q, kv_cache, tables.masked_fill(padding, 0), lengths, scale)


SHAPES = [  # (heads, kv_heads, head_dim, block_size)
    pytest.param((16, 4, 256, 16), id="qwen3.5-16q4kv-d256"),
    pytest.param((8, 2, 256, 16), id="qwen3.5-8q2kv-d256"),
    pytest.param((4, 4, 8, 4), id="mha-small-blocks"),
    pytest.param((6, 1, 12, 40), id="mqa-blocks-wider-than-a-tile"),
    pytest.param((6, 2, 33, 7), id="odd"),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_plain_twin_on_scattered_blocks(shape: tuple[int, int, int, int]) -> None:
    heads, kv_heads, dim, block_size = shape
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 97, 2]
    q, kv_cache, tables, context_lens = _paged(lengths, heads, kv_heads, dim, block_size, seed=block_size + dim)
    scale = dim**-0.5

    got = native_gqa.attend_single_rows(q, kv_cache, tables, context_lens, scale)

    expected = _reference(q, kv_cache, tables, context_lens, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_large_scores_stay_finite_and_match() -> None:
    """The online softmax subtracts the running maximum: scores in the thousands do not overflow."""
    q, kv_cache, tables, lengths = _paged([70, 5, 33], 4, 2, 16, 16, seed=3)
    q = 300 * q

    got = native_gqa.attend_single_rows(q, kv_cache, tables, lengths, 1.0)

    assert bool(got.isfinite().all())
    torch.testing.assert_close(got, _reference(q, kv_cache, tables, lengths, 1.0), rtol=1e-5, atol=1e-4)


def test_a_bf16_cache_is_read_exactly_and_attended_in_fp32() -> None:
    q, kv_cache, tables, lengths = _paged([40, 1, 17], 8, 2, 64, 16, seed=4)
    cache16 = kv_cache.to(torch.bfloat16)

    got = native_gqa.attend_single_rows(q, cache16, tables, lengths, 0.1)

    assert got.dtype == torch.float32
    expected = _reference(q, cache16.float(), tables, lengths, 0.1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_queries_come_back_in_bf16_near_the_reference() -> None:
    """The reference sums bf16 values with bf16 weights; the C kernel in fp32: equal to bf16 rounding."""
    q, kv_cache, tables, lengths = _paged([40, 3, 17], 8, 2, 64, 16, seed=7)
    q16, cache16 = q.bfloat16(), kv_cache.bfloat16()

    got = native_gqa.attend_single_rows(q16, cache16, tables, lengths, 0.125)

    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, _reference(q16, cache16, tables, lengths, 0.125), rtol=2e-2, atol=2e-2)


def test_a_sequence_is_bitwise_the_same_alone_or_batched_at_any_thread_count() -> None:
    q, kv_cache, tables, lengths = _paged([50, 9, 128, 1, 77], 8, 2, 32, 16, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = native_gqa.attend_single_rows(q, kv_cache, tables, lengths, 0.2)
        torch.set_num_threads(1)
        alone = native_gqa.attend_single_rows(q[2:3], kv_cache, tables[2:3], lengths[2:3], 0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], batched[2])


SPLIT = 256  # gqa_decode.c's positions per split: lengths around it and many times it cross splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contexts_over_many_splits_match_the_plain_twin(dtype: torch.dtype) -> None:
    """A long sequence's splits (run by different threads) combine to the one softmax over its context."""
    lengths = [1, 15, 17, SPLIT - 1, SPLIT, SPLIT + 1, 3 * SPLIT + 5, 8192]
    q, kv_cache, tables, context_lens = _paged(lengths, 8, 2, 64, 16, seed=10)
    cache = kv_cache.to(dtype)

    got = native_gqa.attend_single_rows(q, cache, tables, context_lens, 0.125)

    expected = _reference(q, cache.float(), tables, context_lens, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_long_sequence_is_bitwise_the_same_beside_short_ones_at_any_thread_count() -> None:
    lengths = [3, 5000, 17, SPLIT + 1, 1]
    q, kv_cache, tables, context_lens = _paged(lengths, 8, 2, 32, 16, seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = native_gqa.attend_single_rows(q, kv_cache, tables, context_lens, 0.2)
        torch.set_num_threads(1)
        alone = [
            native_gqa.attend_single_rows(q[b : b + 1], kv_cache, tables[b : b + 1], context_lens[b : b + 1], 0.2)[0]
            for b in range(len(lengths))
        ]
    finally:
        torch.set_num_threads(threads)
    for b in range(len(lengths)):
        assert torch.equal(alone[b], batched[b]), f"sequence {b} of {lengths[b]} positions"


def test_heads_that_do_not_group_evenly_are_refused() -> None:
    q, kv_cache, tables, lengths = _paged([5], 6, 4, 8, 4, seed=8)
    with pytest.raises(ValueError, match="6 query heads"):
        native_gqa.attend_single_rows(q, kv_cache, tables, lengths, 1.0)


@pytest.fixture
def backend() -> Iterator[None]:
    previous = ops.kernel_backend()
    yield
    ops.set_kernel_backend(previous)


def test_ops_attend_the_decode_rows_of_a_mixed_batch_in_c_under_auto_only(
    backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads, kv_heads, dim, block_size = 6, 2, 16, 4
    generator = torch.Generator().manual_seed(6)
    _, kv_cache, tables, lengths = _paged([9, 1, 13, 6], heads, kv_heads, dim, block_size, seed=6)
    tables = tables.masked_fill(tables == NOT_A_BLOCK, 0)
    row_counts = [1, 1, 5, 1]  # decode, decode, a prefill chunk, decode
    cu_seqlens = torch.tensor([0, *torch.tensor(row_counts).cumsum(0).tolist()])
    q = torch.randn(sum(row_counts), heads, dim, generator=generator)
    args = (q, kv_cache, tables, cu_seqlens, lengths, 0.3)
    calls: list[int] = []
    real = native_gqa.attend_single_rows

    def counted(q: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls.append(len(q))
        return real(q, *rest)

    monkeypatch.setattr(native_gqa, "attend_single_rows", counted)

    ops.set_kernel_backend(KernelBackend.TORCH)
    expected = ops.paged_gqa_attention(*args)
    assert calls == []
    ops.set_kernel_backend(KernelBackend.AUTO)
    got = ops.paged_gqa_attention(*args)

    assert calls == [3]  # the three one-row sequences, in one call
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
