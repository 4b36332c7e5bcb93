from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from metrale.worker.kernels.mla import (
    _sequence_latents,
    mla_decode_one_row,
    paged_mla_attention,
    paged_mla_decode,
    store_latents,
)
from metrale.worker.kernels.native import graph_ops as native_graph_ops
from metrale.worker.kernels.norm import rms_norm

HEADS, NOPE_DIM, ROPE_DIM, VALUE_DIM, KV_RANK = 3, 8, 4, 6, 16
BLOCK_SIZE, NUM_BLOCKS = 4, 24
SCALE = (NOPE_DIM + ROPE_DIM) ** -0.5
POISON = 1e30
NOT_A_BLOCK = 10**6  # block-table padding: reading it would raise


@dataclass
class PagedBatch:
    """Sequences laid out in a shuffled paged cache, with this step's query rows."""

    kv_cache: torch.Tensor  # [num_blocks, block_size, C + R]
    block_tables: torch.Tensor  # [S, max_blocks]
    cu_seqlens: torch.Tensor  # [S + 1]
    context_lens: torch.Tensor  # [S]
    latents: list[torch.Tensor]  # per sequence [context_len, C + R]
    q_nope: torch.Tensor  # [N, H, Dn]
    q_rope: torch.Tensor  # [N, H, R]

    def attention(self, w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """``paged_mla_attention`` of this batch's rows: ``[N, H, Dv]``."""
        tables = (self.block_tables, self.cu_seqlens, self.context_lens)
        return paged_mla_attention(self.q_nope, self.q_rope, self.kv_cache, *tables, w_uk, w_uv, SCALE)


def _slot_mapping(block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE


def _paged_batch(context_lens: list[int], row_counts: list[int], seed: int) -> PagedBatch:
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(n / BLOCK_SIZE) for n in context_lens]
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    block_tables = torch.full((len(context_lens), max(blocks_needed) + 1), NOT_A_BLOCK)
    kv_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_RANK + ROPE_DIM), POISON)
    latents = []
    for s, (length, needed) in enumerate(zip(context_lens, blocks_needed, strict=True)):
        block_tables[s, :needed] = torch.tensor([free_blocks.pop() for _ in range(needed)])
        latents.append(torch.randn(length, KV_RANK + ROPE_DIM, generator=generator))
        store_latents(kv_cache, latents[-1], _slot_mapping(block_tables[s], torch.arange(length)))
    rows = sum(row_counts)
    return PagedBatch(
        kv_cache=kv_cache,
        block_tables=block_tables,
        cu_seqlens=torch.tensor([0, *torch.tensor(row_counts).cumsum(0).tolist()]),
        context_lens=torch.tensor(context_lens),
        latents=latents,
        q_nope=torch.randn(rows, HEADS, NOPE_DIM, generator=generator),
        q_rope=torch.randn(rows, HEADS, ROPE_DIM, generator=generator),
    )


def _up_projections(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w_uk [H, Dn, C]`` and ``w_uv [H, Dv, C]`` sliced from one ``kv_b_proj``-shaped weight."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(HEADS * (NOPE_DIM + VALUE_DIM), KV_RANK, generator=generator) * KV_RANK**-0.5
    per_head = weight.view(HEADS, NOPE_DIM + VALUE_DIM, KV_RANK)
    return per_head[:, :NOPE_DIM], per_head[:, NOPE_DIM:]


def _dense_expanded_attention(
    q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor
) -> torch.Tensor:
    """Causal attention of the last ``M`` positions with per-head keys and values expanded from latents."""
    compressed, shared_key = latents[:, :KV_RANK], latents[:, KV_RANK:]
    keys = torch.cat(
        [
            torch.einsum("hdc,lc->hld", w_uk, compressed),
            shared_key.expand(HEADS, -1, -1),
        ],
        dim=-1,
    )
    values = torch.einsum("hdc,lc->hld", w_uv, compressed)
    queries = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [H, M, Dn + R]
    context, rows = latents.shape[0], q_nope.shape[0]
    causal = torch.ones(rows, context, dtype=torch.bool).tril(diagonal=context - rows)
    scores = (queries @ keys.transpose(1, 2) * SCALE).masked_fill(~causal, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)


SCENARIOS = [
    pytest.param([9, 1, 17, 4], [1, 1, 1, 1], id="decode-only"),
    pytest.param([6, 13], [6, 5], id="prefill-only"),
    pytest.param([1, 9, 13, 6, 17], [1, 1, 5, 6, 1], id="mixed-decode-and-prefill"),
]


@pytest.mark.parametrize(("context_lens", "row_counts"), SCENARIOS)
def test_paged_absorbed_matches_dense_expanded(context_lens: list[int], row_counts: list[int]) -> None:
    batch = _paged_batch(context_lens, row_counts, seed=len(context_lens))
    w_uk, w_uv = _up_projections(seed=1)

    o = batch.attention(w_uk, w_uv)

    assert o.shape == (sum(row_counts), HEADS, VALUE_DIM)
    assert torch.isfinite(o).all()
    bounds = batch.cu_seqlens.tolist()
    for s, latents in enumerate(batch.latents):
        rows = slice(bounds[s], bounds[s + 1])
        expected = _dense_expanded_attention(batch.q_nope[rows], batch.q_rope[rows], latents, w_uk, w_uv)
        torch.testing.assert_close(o[rows], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("consecutive", [True, False], ids=["blocks-in-order", "blocks-scattered"])
@pytest.mark.parametrize("context_len", [1, 4, 5, 17])
def test_one_row_decode_matches_the_batched_reference(context_len: int, consecutive: bool) -> None:
    """One stream's decode step (``mla_decode_one_row``, latents read in place) against the reference."""
    batch = _paged_batch([context_len], [1], seed=context_len)
    if consecutive:  # the same latents moved to blocks 2, 3, ...
        needed = math.ceil(context_len / BLOCK_SIZE)
        table = torch.arange(2, 2 + needed)
        batch.kv_cache.fill_(POISON)
        store_latents(batch.kv_cache, batch.latents[0], _slot_mapping(table, torch.arange(context_len)))
        batch.block_tables[0, :needed] = table
    w_uk, w_uv = _up_projections(seed=2)
    expected = batch.attention(w_uk, w_uv)

    got = mla_decode_one_row(
        batch.q_nope, batch.q_rope, batch.kv_cache, batch.block_tables[0], context_len, w_uk, w_uv, SCALE
    )

    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_static_shape_decode_matches_the_reference_and_keeps_padding_rows_finite() -> None:
    """``paged_mla_decode`` (the compiled step's MLA) scores every position of each block table, masked
    past the context; the batch ends with a padding row (no context, a table of block 0)."""
    batch = _paged_batch([9, 1, 17, 4], [1, 1, 1, 1], seed=7)
    w_uk, w_uv = _up_projections(seed=3)
    expected = batch.attention(w_uk, w_uv)
    tables = batch.block_tables.masked_fill(batch.block_tables == NOT_A_BLOCK, 0)
    tables = torch.cat([tables, torch.zeros_like(tables[:1])])
    q_nope, q_rope = (torch.cat([q, torch.ones_like(q[:1])]) for q in (batch.q_nope, batch.q_rope))

    got = paged_mla_decode(
        q_nope, q_rope, batch.kv_cache, tables, torch.cat([batch.context_lens, torch.tensor([0])]), w_uk, w_uv, SCALE
    )

    torch.testing.assert_close(got[:4], expected, rtol=1e-5, atol=1e-5)
    assert bool(got[4].isfinite().all())


def test_static_shape_decode_through_the_c_kernel_op_matches_the_reference() -> None:
    """The compiled step's MLA where the C++ graph ops load: ``paged_mla_decode`` with its attention in
    latent space through ``metrale_native::mla_decode_latent`` (each row's own context, read in place
    through a shuffled block table), equal to the reference to rounding; the padding row gives zeros."""
    assert native_graph_ops.load()
    batch = _paged_batch([9, 1, 17, 4], [1, 1, 1, 1], seed=11)
    w_uk, w_uv = _up_projections(seed=5)
    expected = batch.attention(w_uk, w_uv)
    tables = batch.block_tables.masked_fill(batch.block_tables == NOT_A_BLOCK, 0)
    tables = torch.cat([tables, torch.zeros_like(tables[:1])])
    q_nope, q_rope = (torch.cat([q, torch.ones_like(q[:1])]) for q in (batch.q_nope, batch.q_rope))
    lengths = torch.cat([batch.context_lens, torch.tensor([0])])

    got = paged_mla_decode(
        q_nope, q_rope, batch.kv_cache, tables, lengths, w_uk, w_uv, SCALE, torch.ops.metrale_native.mla_decode_latent
    )

    torch.testing.assert_close(got[:4], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[4], torch.zeros_like(got[4]))


def test_one_row_decode_reads_consecutive_blocks_in_place() -> None:
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_RANK + ROPE_DIM)
    latents = _sequence_latents(cache, torch.tensor([3, 4, 5, NOT_A_BLOCK]), 3 * BLOCK_SIZE - 1)
    assert latents.data_ptr() == cache[3].data_ptr()
    assert torch.equal(latents, cache[3:6].reshape(-1, KV_RANK + ROPE_DIM)[:-1])


def test_store_latents_writes_only_the_mapped_slots() -> None:
    cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_RANK + ROPE_DIM), POISON)
    latents = torch.randn(3, KV_RANK + ROPE_DIM, generator=torch.Generator().manual_seed(2))
    places = [(7, 3), (0, 0), (7, 1)]

    store_latents(cache, latents, torch.tensor([block * BLOCK_SIZE + offset for block, offset in places]))

    written = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    for row, (block, offset) in enumerate(places):
        assert torch.equal(cache[block, offset], latents[row])
        written[block, offset] = True
    assert (cache[~written] == POISON).all()


def test_matches_transformers_attention_layer_with_absorbed_weights() -> None:
    torch.manual_seed(3)
    config = KimiLinearConfig(
        hidden_size=32,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=KV_RANK,
        q_lora_rank=None,
        qk_nope_head_dim=NOPE_DIM,
        qk_rope_head_dim=ROPE_DIM,
        v_head_dim=VALUE_DIM,
    )
    config._attn_implementation = "eager"
    layer = KimiLinearAttention(config, layer_idx=0).eval()
    length = 11
    hidden = torch.randn(1, length, config.hidden_size)
    causal_mask = torch.full((length, length), float("-inf")).triu(diagonal=1)[None, None]
    with torch.no_grad():
        expected, _ = layer(hidden, attention_mask=causal_mask)
        o = _absorbed_layer_forward(layer, hidden[0])

    torch.testing.assert_close(o, expected[0], rtol=1e-5, atol=1e-5)


def _absorbed_layer_forward(layer: KimiLinearAttention, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's projections around ``store_latents`` + ``paged_mla_attention`` for one fresh sequence."""
    length = hidden.shape[0]
    assert layer.q_proj is not None
    queries = layer.q_proj(hidden).view(length, HEADS, NOPE_DIM + ROPE_DIM)
    compressed, shared_key = layer.kv_a_proj_with_mqa(hidden).split([KV_RANK, ROPE_DIM], dim=-1)
    normed = rms_norm(compressed, layer.kv_a_layernorm.weight, layer.kv_a_layernorm.variance_epsilon)
    block_table = torch.tensor([5, 2, 9])
    kv_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_RANK + ROPE_DIM), POISON)
    store_latents(kv_cache, torch.cat([normed, shared_key], dim=-1), _slot_mapping(block_table, torch.arange(length)))
    per_head = layer.kv_b_proj.weight.view(HEADS, NOPE_DIM + VALUE_DIM, KV_RANK)
    o = paged_mla_attention(
        queries[..., :NOPE_DIM],
        queries[..., NOPE_DIM:],
        kv_cache,
        block_table.unsqueeze(0),
        torch.tensor([0, length]),
        torch.tensor([length]),
        per_head[:, :NOPE_DIM],
        per_head[:, NOPE_DIM:],
        layer.scaling,
    )
    return layer.o_proj(o.reshape(length, HEADS * VALUE_DIM))
