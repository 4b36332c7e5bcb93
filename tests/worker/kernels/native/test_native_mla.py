"""The C latent attention for decode rows against its plain twin (``kernels.mla._attend_single_rows``)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import mla, ops
from metrale.worker.kernels.native import mla as native_mla

NOT_A_BLOCK = 10**6  # block-table padding past a sequence's blocks: never read


def _paged(
    context_lens: list[int], heads: int, kv_rank: int, rope: int, block_size: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """A cache of random latents in shuffled blocks, its block tables, and one query row per sequence:
    ``(q_latent [B, H, C], q_rope [B, H, R], kv_cache, block_tables, context_lens)``."""
    generator = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    kv_cache = torch.randn(num_blocks, block_size, kv_rank + rope, generator=generator)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((len(context_lens), max(needed) + 1), NOT_A_BLOCK)
    for s, count in enumerate(needed):
        tables[s, :count] = torch.tensor([free.pop() for _ in range(count)])
    q_latent = torch.randn(len(context_lens), heads, kv_rank, generator=generator)
    q_rope = torch.randn(len(context_lens), heads, rope, generator=generator)
    return q_latent, q_rope, kv_cache, tables, torch.tensor(context_lens)


def _reference(q_latent: torch.Tensor, q_rope: torch.Tensor, *rest: torch.Tensor, scale: float) -> torch.Tensor:
    kv_cache, tables, lengths = rest
    padding = tables == NOT_A_BLOCK  # the reference gathers a rectangle: point its padding at a real block
    return mla._attend_single_rows(q_latent, q_rope, kv_cache, tables.masked_fill(padding, 0), lengths, scale)


SHAPES = [
    pytest.param((4, 128, 32, 16), id="kimi-bench"),
    pytest.param((3, 16, 4, 4), id="small-blocks"),
    pytest.param((2, 24, 8, 40), id="blocks-wider-than-a-tile"),
    pytest.param((5, 33, 7, 16), id="odd"),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_plain_twin_on_scattered_blocks(shape: tuple[int, int, int, int]) -> None:
    heads, kv_rank, rope, block_size = shape
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 97, 2]
    inputs = _paged(lengths, heads, kv_rank, rope, block_size, seed=block_size)
    scale = (kv_rank + rope) ** -0.5

    got = native_mla.attend_single_rows(*inputs, scale)

    torch.testing.assert_close(got, _reference(*inputs, scale=scale), rtol=1e-5, atol=1e-5)


def test_large_scores_stay_finite_and_match() -> None:
    """The online softmax subtracts the running maximum: scores in the thousands do not overflow."""
    q_latent, q_rope, *rest = _paged([70, 5, 33], 4, 32, 8, 16, seed=3)
    q_latent, q_rope = 300 * q_latent, 300 * q_rope

    got = native_mla.attend_single_rows(q_latent, q_rope, *rest, 1.0)

    assert bool(got.isfinite().all())
    torch.testing.assert_close(got, _reference(q_latent, q_rope, *rest, scale=1.0), rtol=1e-5, atol=1e-4)


def test_a_bf16_cache_is_read_exactly_and_attended_in_fp32() -> None:
    q_latent, q_rope, kv_cache, tables, lengths = _paged([40, 1, 17], 4, 64, 16, 16, seed=4)
    cache16 = kv_cache.to(torch.bfloat16)

    got = native_mla.attend_single_rows(q_latent, q_rope, cache16, tables, lengths, 0.1)

    assert got.dtype == torch.float32
    expected = _reference(q_latent, q_rope, cache16.float(), tables, lengths, scale=0.1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_sequence_is_bitwise_the_same_alone_or_batched_at_any_thread_count() -> None:
    q_latent, q_rope, kv_cache, tables, lengths = _paged([50, 9, 128, 1, 77], 4, 128, 32, 16, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = native_mla.attend_single_rows(q_latent, q_rope, kv_cache, tables, lengths, 0.2)
        torch.set_num_threads(1)
        alone = native_mla.attend_single_rows(q_latent[2:3], q_rope[2:3], kv_cache, tables[2:3], lengths[2:3], 0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], batched[2])


@pytest.fixture
def backend() -> Iterator[None]:
    previous = ops.kernel_backend()
    yield
    ops.set_kernel_backend(previous)


def test_ops_attend_the_decode_rows_of_a_mixed_batch_in_c_under_auto_only(
    backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads, nope, rope, value, kv_rank, block_size = 3, 8, 4, 6, 16, 4
    generator = torch.Generator().manual_seed(6)
    _, _, kv_cache, tables, lengths = _paged([9, 1, 13, 6], heads, kv_rank, rope, block_size, seed=6)
    tables = tables.masked_fill(tables == NOT_A_BLOCK, 0)
    row_counts = [1, 1, 5, 1]  # decode, decode, a prefill chunk, decode
    cu_seqlens = torch.tensor([0, *torch.tensor(row_counts).cumsum(0).tolist()])
    q_nope = torch.randn(sum(row_counts), heads, nope, generator=generator)
    q_rope = torch.randn(sum(row_counts), heads, rope, generator=generator)
    w_kv = torch.randn(heads, nope + value, kv_rank, generator=generator) * kv_rank**-0.5
    args = (q_nope, q_rope, kv_cache, tables, cu_seqlens, lengths, w_kv[:, :nope], w_kv[:, nope:], 0.3)
    calls: list[int] = []
    real = native_mla.attend_single_rows
    monkeypatch.setattr(native_mla, "attend_single_rows", lambda *a: calls.append(len(a[0])) or real(*a))

    ops.set_kernel_backend(KernelBackend.TORCH)
    expected = ops.paged_mla_attention(*args)
    assert calls == []
    ops.set_kernel_backend(KernelBackend.AUTO)
    got = ops.paged_mla_attention(*args)

    assert calls == [3]  # the three one-row sequences, in one call
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


SPLIT = 256  # mla_decode.c's positions per split: lengths around it and many times it cross splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contexts_over_many_splits_match_the_plain_twin(dtype: torch.dtype) -> None:
    """A long sequence's splits (run by different threads) combine to the one softmax over its context."""
    lengths = [1, 15, 17, SPLIT - 1, SPLIT, SPLIT + 1, 3 * SPLIT + 5, 8192]
    q_latent, q_rope, kv_cache, tables, context_lens = _paged(lengths, 4, 128, 32, 16, seed=7)
    cache = kv_cache.to(dtype)

    got = native_mla.attend_single_rows(q_latent, q_rope, cache, tables, context_lens, 0.08)

    expected = _reference(q_latent, q_rope, cache.float(), tables, context_lens, scale=0.08)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_split_whose_scores_are_far_below_another_weighs_nothing() -> None:
    """Splits combine relative to the best maximum: a split of much lower scores adds ~0, not NaN."""
    q_latent, q_rope, kv_cache, tables, lengths = _paged([2 * SPLIT], 2, 16, 4, 16, seed=8)
    block_size = kv_cache.shape[1]
    second_half = tables[0, SPLIT // block_size : 2 * SPLIT // block_size]
    kv_cache[second_half] = -kv_cache[second_half].abs() * 50
    q_latent, q_rope = q_latent.abs() * 20, q_rope.abs() * 20

    got = native_mla.attend_single_rows(q_latent, q_rope, kv_cache, tables, lengths, 1.0)

    assert bool(got.isfinite().all())
    # Scores here reach ~320, where an fp32 score is only good to ~3e-5, and a weight's relative error is
    # its score's absolute one: compared with the float64 reference, to that precision.
    exact = _reference(q_latent.double(), q_rope.double(), kv_cache.double(), tables, lengths, scale=1.0)
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4)


def test_a_long_sequence_is_bitwise_the_same_beside_short_ones_at_any_thread_count() -> None:
    lengths = [3, 5000, 17, SPLIT + 1, 1]
    q_latent, q_rope, kv_cache, tables, context_lens = _paged(lengths, 4, 64, 16, 16, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = native_mla.attend_single_rows(q_latent, q_rope, kv_cache, tables, context_lens, 0.1)
        torch.set_num_threads(1)
        alone = [
            native_mla.attend_single_rows(
                q_latent[b : b + 1], q_rope[b : b + 1], kv_cache, tables[b : b + 1], context_lens[b : b + 1], 0.1
            )[0]
            for b in range(len(lengths))
        ]
    finally:
        torch.set_num_threads(threads)
    for b in range(len(lengths)):
        assert torch.equal(alone[b], batched[b]), f"sequence {b} of {lengths[b]} positions"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_len", [1, 15, 17, 8192], ids=lambda n: f"context-{n}")
def test_a_lone_decode_row_runs_the_c_kernel_and_matches_the_reference(
    backend: None, monkeypatch: pytest.MonkeyPatch, context_len: int, dtype: torch.dtype
) -> None:
    """One stream's step (``ops.paged_mla_attention`` of one row) attends in C under ``auto`` and equals the
    torch reference (block size 16: contexts of one position, a block less one, a block and one, 8k)."""
    heads, nope, rope, value, kv_rank = 4, 32, 16, 32, 64
    generator = torch.Generator().manual_seed(context_len)
    _, _, kv_cache, tables, lengths = _paged([context_len], heads, kv_rank, rope, 16, seed=context_len)
    kv_cache = kv_cache.to(dtype)
    q_nope = torch.randn(1, heads, nope, generator=generator).to(dtype)
    q_rope = torch.randn(1, heads, rope, generator=generator).to(dtype)
    w_kv = (torch.randn(heads, nope + value, kv_rank, generator=generator) * kv_rank**-0.5).to(dtype)
    cu_seqlens, w_uk, w_uv = torch.tensor([0, 1]), w_kv[:, :nope], w_kv[:, nope:]
    calls: list[int] = []
    real = native_mla.attend_single_rows

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(len(args[0]))
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(native_mla, "attend_single_rows", counted)

    ops.set_kernel_backend(KernelBackend.TORCH)
    padded = tables.masked_fill(tables == NOT_A_BLOCK, 0)  # the reference gathers a rectangle
    expected = ops.paged_mla_attention(q_nope, q_rope, kv_cache, padded, cu_seqlens, lengths, w_uk, w_uv, 0.15)
    ops.set_kernel_backend(KernelBackend.AUTO)
    got = ops.paged_mla_attention(q_nope, q_rope, kv_cache, tables, cu_seqlens, lengths, w_uk, w_uv, 0.15)

    assert calls == [1]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the reference rounds its products to bf16
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
