"""The tiled prefill attention (``kernels.tiled_prefill``) against its plain twins, the whole-context
``mla._attend_sequence_rows`` and ``gqa._attend_sequence_rows``: fp32 tight, bf16 loose; chunks that
start mid-block and mid-tile, contexts that are not a multiple of a tile, several sequences in one
batch; and a row's output bitwise the same however its prompt is split into chunks."""

from __future__ import annotations

import pytest
import torch

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import gqa, mla, ops, tiled_prefill
from metrale.worker.kernels.tiled_prefill import gqa_sequence_rows, key_tiles, mla_sequence_rows

BLOCK_SIZE = 4
POISON = 1e30  # cache rows no sequence owns: reading one into a sum would show
NOT_A_BLOCK = 10**6  # block-table padding: reading it would raise
MLA_SHAPE = {"heads": 3, "kv_rank": 16, "rope": 4}
SCALE = 0.3


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 4, 4, 8, 16, 16, ... positions and 48 score rows, so short sequences cross many tiles."""
    monkeypatch.setattr(tiled_prefill, "FIRST_KEY_TILE", 4)
    monkeypatch.setattr(tiled_prefill, "KEY_TILE", 16)
    monkeypatch.setattr(tiled_prefill, "SCORE_ROWS", 48)


def _paged(
    context_len: int, width: tuple[int, ...], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A poisoned cache of ``width``-shaped rows holding one sequence's ``context_len`` random rows in
    shuffled blocks, and its block table (padded with ``NOT_A_BLOCK``)."""
    generator = torch.Generator().manual_seed(seed)
    needed = -(-context_len // BLOCK_SIZE)
    num_blocks = needed + 3
    blocks = torch.randperm(num_blocks, generator=generator)[:needed]
    cache = torch.full((num_blocks, BLOCK_SIZE, *width), POISON)
    rows = torch.randn(context_len, *width, generator=generator)
    flat = cache.view(-1, *width)
    positions = torch.arange(context_len)
    flat[blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE] = rows
    table = torch.cat([blocks, torch.full((2,), NOT_A_BLOCK)])
    return cache.to(dtype), table


def _mla_inputs(
    context_len: int, rows: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, kv_rank, rope = MLA_SHAPE["heads"], MLA_SHAPE["kv_rank"], MLA_SHAPE["rope"]
    cache, table = _paged(context_len, (kv_rank + rope,), dtype, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    q_latent = torch.randn(rows, heads, kv_rank, generator=generator).to(dtype)
    q_rope = torch.randn(rows, heads, rope, generator=generator).to(dtype)
    return q_latent, q_rope, cache, table


def _gqa_inputs(
    context_len: int, rows: int, heads: int, kv_heads: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cache, table = _paged(context_len, (2, kv_heads, 8), dtype, seed)
    q = torch.randn(rows, heads, 8, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, cache, table


def test_key_tiles_double_then_hold() -> None:
    assert key_tiles(1) == [(0, 64)]
    assert key_tiles(65) == [(0, 64), (64, 64)]
    doubling = [(0, 64), (64, 64), (128, 128), (256, 256), (512, 512), (1024, 1024)]
    assert key_tiles(5000) == [*doubling, (2048, 2048), (4096, 2048)]


CHUNKS = [
    pytest.param(1, 1, id="one-position"),
    pytest.param(9, 9, id="whole-prompt-mid-block"),
    pytest.param(37, 37, id="whole-prompt-several-tiles"),
    pytest.param(37, 5, id="chunk-starting-mid-tile"),
    pytest.param(48, 16, id="chunk-on-tile-bounds"),
    pytest.param(50, 2, id="two-rows-deep"),
]


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(("context_len", "rows"), CHUNKS)
def test_mla_matches_the_whole_context_twin(context_len: int, rows: int) -> None:
    q_latent, q_rope, cache, table = _mla_inputs(context_len, rows, seed=context_len + rows)

    got = mla_sequence_rows(q_latent, q_rope, cache, table, context_len, SCALE)

    expected = mla._attend_sequence_rows(q_latent, q_rope, cache, table, context_len, SCALE)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize(("context_len", "rows"), CHUNKS)
def test_gqa_matches_the_whole_context_twin(context_len: int, rows: int, heads: int, kv_heads: int) -> None:
    q, cache, table = _gqa_inputs(context_len, rows, heads, kv_heads, seed=context_len)

    got = gqa_sequence_rows(q, cache, table, context_len, SCALE)

    expected = gqa._attend_sequence_rows(q, cache, table, context_len, SCALE)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_default_tiles_match_the_twins_past_a_full_tile() -> None:
    """The shipped tile sizes: a 2,100-position context crosses the doubling tiles into a full one."""
    context_len, rows = 2100, 300
    q_latent, q_rope, cache, table = _mla_inputs(context_len, rows, seed=5)
    torch.testing.assert_close(
        mla_sequence_rows(q_latent, q_rope, cache, table, context_len, SCALE),
        mla._attend_sequence_rows(q_latent, q_rope, cache, table, context_len, SCALE),
        rtol=1e-5,
        atol=1e-5,
    )
    q, cache, table = _gqa_inputs(context_len, rows, 4, 2, seed=6)
    torch.testing.assert_close(
        gqa_sequence_rows(q, cache, table, context_len, SCALE),
        gqa._attend_sequence_rows(q, cache, table, context_len, SCALE),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.usefixtures("small_tiles")
def test_bf16_caches_match_the_twins_loosely() -> None:
    q_latent, q_rope, cache, table = _mla_inputs(41, 13, dtype=torch.bfloat16, seed=3)
    got = mla_sequence_rows(q_latent, q_rope, cache, table, 41, SCALE)
    assert got.dtype == torch.bfloat16
    expected = mla._attend_sequence_rows(q_latent, q_rope, cache, table, 41, SCALE)
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)

    q, cache, table = _gqa_inputs(41, 13, 4, 2, dtype=torch.bfloat16, seed=4)
    got = gqa_sequence_rows(q, cache, table, 41, SCALE)
    assert got.dtype == torch.bfloat16
    expected = gqa._attend_sequence_rows(q, cache, table, 41, SCALE)
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)


SPLITS = [[53], [1, 52], [7, 9, 16, 21], [20, 1, 1, 31], [16, 16, 16, 5]]


@pytest.mark.usefixtures("small_tiles")
def test_a_rows_output_does_not_depend_on_how_its_prompt_was_chunked() -> None:
    """Bitwise: every split of a 53-position prompt gives each position the bits of the one-chunk run."""
    context_len = 53
    q_latent, q_rope, cache, table = _mla_inputs(context_len, context_len, seed=8)
    q, gqa_cache, gqa_table = _gqa_inputs(context_len, context_len, 6, 2, seed=9)
    whole_mla = mla_sequence_rows(q_latent, q_rope, cache, table, context_len, SCALE)
    whole_gqa = gqa_sequence_rows(q, gqa_cache, gqa_table, context_len, SCALE)
    for split in SPLITS[1:]:
        start = 0
        for length in split:
            rows = slice(start, start + length)
            chunk = mla_sequence_rows(q_latent[rows], q_rope[rows], cache, table, start + length, SCALE)
            assert torch.equal(chunk, whole_mla[rows]), (split, start)
            chunk = gqa_sequence_rows(q[rows], gqa_cache, gqa_table, start + length, SCALE)
            assert torch.equal(chunk, whole_gqa[rows]), (split, start)
            start += length


@pytest.mark.usefixtures("small_tiles")
def test_paged_attention_takes_the_tiled_rows_for_every_chunk_of_a_mixed_batch() -> None:
    """A batch of a decode row and two prefill chunks through ``paged_mla_attention`` /
    ``paged_gqa_attention`` with the tiled function equals the same batch through the twins."""
    generator = torch.Generator().manual_seed(11)
    heads, kv_rank, rope, dim = MLA_SHAPE["heads"], MLA_SHAPE["kv_rank"], MLA_SHAPE["rope"], 8
    context_lens, row_counts = [19, 1, 34], [7, 1, 34]
    blocks_each = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks_each) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((3, max(blocks_each) + 1), NOT_A_BLOCK)
    for s, needed in enumerate(blocks_each):
        tables[s, :needed] = torch.tensor([order.pop() for _ in range(needed)])
    latent_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_rank + rope, generator=generator)
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, 2, 2, dim, generator=generator)
    rows = sum(row_counts)
    cu_seqlens = torch.tensor([0, *torch.tensor(row_counts).cumsum(0).tolist()])
    lengths = torch.tensor(context_lens)
    q_nope, q_rope = (
        torch.randn(rows, heads, 8, generator=generator),
        torch.randn(rows, heads, rope, generator=generator),
    )
    w_uk, w_uv = (
        torch.randn(heads, 8, kv_rank, generator=generator),
        torch.randn(heads, 6, kv_rank, generator=generator),
    )
    args = (q_nope, q_rope, latent_cache, tables, cu_seqlens, lengths, w_uk, w_uv, SCALE)
    torch.testing.assert_close(
        mla.paged_mla_attention(*args, attend_sequence_rows=mla_sequence_rows),
        mla.paged_mla_attention(*args),
        rtol=1e-5,
        atol=1e-5,
    )
    q = torch.randn(rows, 4, dim, generator=generator)
    gqa_args = (q, kv_cache, tables, cu_seqlens, lengths, SCALE)
    torch.testing.assert_close(
        gqa.paged_gqa_attention(*gqa_args, sequence_rows=gqa_sequence_rows),
        gqa.paged_gqa_attention(*gqa_args),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("backend", [KernelBackend.NATIVE, KernelBackend.TORCH])
def test_ops_tiles_prefill_chunks_under_every_backend_but_torch(backend: KernelBackend) -> None:
    """``ops.paged_mla_attention`` / ``ops.paged_gqa_attention`` on two prefill chunks: the tiled rows'
    bits under ``native`` (as under ``auto`` on the CPU), the reference's under ``torch``."""
    _, q_rope, cache, table = _mla_inputs(30, 30, seed=12)
    heads, kv_rank = MLA_SHAPE["heads"], MLA_SHAPE["kv_rank"]
    generator = torch.Generator().manual_seed(13)
    w_uk, w_uv = (
        torch.randn(heads, 8, kv_rank, generator=generator),
        torch.randn(heads, 6, kv_rank, generator=generator),
    )
    q_nope = torch.randn(30, heads, 8, generator=generator)
    tables = torch.stack([table, table])
    cu_seqlens, lengths = torch.tensor([0, 12, 30]), torch.tensor([12, 30])  # two chunks over one cache
    args = (q_nope, q_rope, cache, tables, cu_seqlens, lengths, w_uk, w_uv, SCALE)
    q, kv_cache, kv_table = _gqa_inputs(30, 30, 4, 2, seed=14)
    gqa_args = (q, kv_cache, torch.stack([kv_table, kv_table]), cu_seqlens, lengths, SCALE)
    tiled = backend is not KernelBackend.TORCH
    previous = ops.kernel_backend()
    ops.set_kernel_backend(backend)
    try:
        got_mla, got_gqa = ops.paged_mla_attention(*args), ops.paged_gqa_attention(*gqa_args)
    finally:
        ops.set_kernel_backend(previous)
    assert torch.equal(
        got_mla, mla.paged_mla_attention(*args, attend_sequence_rows=mla_sequence_rows if tiled else None)
    )
    assert torch.equal(got_gqa, gqa.paged_gqa_attention(*gqa_args, sequence_rows=gqa_sequence_rows if tiled else None))
