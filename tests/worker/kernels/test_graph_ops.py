"""The custom ops a compiled decode step calls: the eager kernels on the real rows, padding rows skipped
(zeros out, no state read or written). Run eagerly here; tests/worker/model/test_decode_graph.py
compiles them."""

from __future__ import annotations

import pytest
import torch

from metrale.worker.kernels import ops
from metrale.worker.kernels.graph_ops import PAD_SLOT

H, K, D, W, SLOTS = 2, 8, 12, 4, 6


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("real", [1, 3, 4], ids=lambda n: f"{n}of4real")
def test_kda_decode_runs_the_real_rows_and_leaves_every_other_slot(real: int) -> None:
    pool = _randn(SLOTS, H, K, K, seed=0)
    slots = torch.tensor([4, 1, 2, 0][:real] + [PAD_SLOT] * (4 - real))
    q, k, v = (_randn(4, H, K, seed=s) for s in (1, 2, 3))
    g, beta = -_randn(4, H, K, seed=4).abs(), _randn(4, H, seed=5).sigmoid()
    expected_pool = pool.clone()
    expected = ops.kda_decode(q[:real], k[:real], v[:real], g[:real], beta[:real], expected_pool, slots[:real], 0.5)

    got = torch.ops.metrale.kda_decode(q, k, v, g, beta, pool, slots, 0.5)

    assert torch.equal(got[:real], expected)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    assert torch.equal(pool, expected_pool)  # the same rows advanced, the others (5, 3, ...) untouched


@pytest.mark.parametrize("real", [1, 2, 4], ids=lambda n: f"{n}of4real")
def test_conv_update_runs_the_real_rows_and_leaves_every_other_slot(real: int) -> None:
    states, weight, x = _randn(SLOTS, D, W - 1, seed=0), _randn(D, W, seed=1), _randn(4, D, seed=2)
    slots = torch.tensor([5, 0, 3, 1][:real] + [PAD_SLOT] * (4 - real))
    expected_states = states.clone()
    expected = ops.causal_conv1d_update(x[:real], weight, expected_states, slots[:real])

    got = torch.ops.metrale.causal_conv1d_update(x, weight, states, slots)

    assert torch.equal(got[:real], expected)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    assert torch.equal(states, expected_states)


def test_mla_ops_skip_padding_rows() -> None:
    """Two real decode rows and two padding rows: latents stored for the real rows only, attention equal
    to the eager kernel's on them, zeros on the padding."""
    heads, nope, rope, rank, dv, block = 2, 4, 3, 5, 6, 4
    cache = _randn(6, block, rank + rope, seed=0)
    block_tables = torch.tensor([[0, 1], [2, 3], [0, 0], [0, 0]])
    context_lens = torch.tensor([6, 3, 0, 0])
    slot_mapping = torch.tensor([1 * block + 1, 3 * block + 2, PAD_SLOT, PAD_SLOT])
    latents = _randn(4, rank + rope, seed=1)
    q_nope, q_rope = _randn(4, heads, nope, seed=2), _randn(4, heads, rope, seed=3)
    w_uk, w_uv = _randn(heads, nope, rank, seed=4), _randn(heads, dv, rank, seed=5)
    expected_cache = cache.clone()
    ops.store_latents(expected_cache, latents[:2], slot_mapping[:2])

    torch.ops.metrale.store_latents(cache, latents, slot_mapping)
    got = torch.ops.metrale.paged_mla_decode(q_nope, q_rope, cache, block_tables, context_lens, w_uk, w_uv, 0.3)

    assert torch.equal(cache, expected_cache)
    expected = ops.paged_mla_attention(
        q_nope[:2], q_rope[:2], cache, block_tables[:2], torch.arange(3), context_lens[:2], w_uk, w_uv, 0.3
    )
    assert torch.equal(got[:2], expected)
    assert torch.equal(got[2:], torch.zeros_like(got[2:]))
