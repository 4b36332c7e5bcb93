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


def test_store_latents_skips_padding_rows() -> None:
    cache, latents = _randn(6, 4, 8, seed=0), _randn(4, 8, seed=1)
    slot_mapping = torch.tensor([5, 13, PAD_SLOT, PAD_SLOT])
    expected = cache.clone()
    ops.store_latents(expected, latents[:2], slot_mapping[:2])

    torch.ops.metrale.store_latents(cache, latents, slot_mapping)

    assert torch.equal(cache, expected)
