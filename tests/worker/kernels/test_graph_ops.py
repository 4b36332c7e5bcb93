"""The custom ops a compiled decode step calls: the eager kernels on the real rows, padding rows skipped
(zeros out, no state read or written). Both sets: the Python ops (``torch.ops.metrale``) and their C++
twins over the same C kernels (``torch.ops.metrale_native``), which must give the same bits. Run eagerly
here; tests/worker/model/test_decode_graph.py compiles them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import ops
from metrale.worker.kernels.graph_ops import PAD_SLOT
from metrale.worker.kernels.native import graph_ops as native_graph_ops
from metrale.worker.kernels.native import mla as native_mla

H, K, D, W, SLOTS = 2, 8, 12, 4, 6


@pytest.fixture(autouse=True)
def auto_backend() -> Iterator[None]:
    """The C kernels on the CPU (an earlier test may have left another backend set)."""
    previous = ops.kernel_backend()
    ops.set_kernel_backend(KernelBackend.AUTO)
    yield
    ops.set_kernel_backend(previous)


@pytest.fixture(params=["metrale", "metrale_native"])
def graph_ops(request: pytest.FixtureRequest) -> object:
    """The ops of one namespace; the C++ library must build here (a compiler is on the path)."""
    if request.param == "metrale_native":
        assert native_graph_ops.load()
    return getattr(torch.ops, request.param)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("real", [1, 3, 4], ids=lambda n: f"{n}of4real")
def test_kda_decode_runs_the_real_rows_and_leaves_every_other_slot(graph_ops: object, real: int) -> None:
    pool = _randn(SLOTS, H, K, K, seed=0)
    slots = torch.tensor([4, 1, 2, 0][:real] + [PAD_SLOT] * (4 - real))
    q, k, v = (_randn(4, H, K, seed=s) for s in (1, 2, 3))
    g, beta = -_randn(4, H, K, seed=4).abs(), _randn(4, H, seed=5).sigmoid()
    expected_pool = pool.clone()
    expected = ops.kda_decode(q[:real], k[:real], v[:real], g[:real], beta[:real], expected_pool, slots[:real], 0.5)

    got = graph_ops.kda_decode(q, k, v, g, beta, pool, slots, 0.5)

    assert torch.equal(got[:real], expected)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    assert torch.equal(pool, expected_pool)  # the same rows advanced, the others (5, 3, ...) untouched


@pytest.mark.parametrize("real", [1, 2, 4], ids=lambda n: f"{n}of4real")
def test_conv_update_runs_the_real_rows_and_leaves_every_other_slot(graph_ops: object, real: int) -> None:
    states, weight, x = _randn(SLOTS, D, W - 1, seed=0), _randn(D, W, seed=1), _randn(4, D, seed=2)
    slots = torch.tensor([5, 0, 3, 1][:real] + [PAD_SLOT] * (4 - real))
    expected_states = states.clone()
    expected = ops.causal_conv1d_update(x[:real], weight, expected_states, slots[:real])

    got = graph_ops.causal_conv1d_update(x, weight, states, slots)

    assert torch.equal(got[:real], expected)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    assert torch.equal(states, expected_states)


def test_store_latents_skips_padding_rows(graph_ops: object) -> None:
    cache, latents = _randn(6, 4, 8, seed=0), _randn(4, 8, seed=1)
    slot_mapping = torch.tensor([5, 13, PAD_SLOT, PAD_SLOT])
    expected = cache.clone()
    ops.store_latents(expected, latents[:2], slot_mapping[:2])

    graph_ops.store_latents(cache, latents, slot_mapping)

    assert torch.equal(cache, expected)


def test_native_kda_decode_takes_bf16_inputs_as_the_python_op_does() -> None:
    assert native_graph_ops.load()
    pool = _randn(SLOTS, H, K, K, seed=0)
    slots = torch.tensor([3, 0, PAD_SLOT])
    q, k, v, g = (_randn(3, H, K, seed=s).bfloat16() for s in (1, 2, 3, 4))
    beta = _randn(3, H, seed=5).sigmoid().bfloat16()
    expected_pool = pool.clone()
    expected = torch.ops.metrale.kda_decode(q, k, v, -g.abs(), beta, expected_pool, slots, 0.25)

    got = torch.ops.metrale_native.kda_decode(q, k, v, -g.abs(), beta, pool, slots, 0.25)

    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)
    assert torch.equal(pool, expected_pool)


def test_native_conv_update_reads_rows_of_a_wider_tensor() -> None:
    """The graph passes the conv a column slice of a fused projection: rows ``stride(0) > D`` apart."""
    assert native_graph_ops.load()
    states, weight = _randn(SLOTS, D, W - 1, seed=0), _randn(D, W, seed=1)
    fused = _randn(3, 3 * D, seed=2)
    x = fused[:, D : 2 * D]
    slots = torch.tensor([2, 4, 1])
    expected_states = states.clone()
    expected = torch.ops.metrale.causal_conv1d_update(x.contiguous(), weight, expected_states, slots)

    got = torch.ops.metrale_native.causal_conv1d_update(x, weight, states, slots)

    assert torch.equal(got, expected)
    assert torch.equal(states, expected_states)


def test_native_store_latents_casts_into_a_bf16_cache() -> None:
    assert native_graph_ops.load()
    cache, latents = torch.zeros(6, 4, 8, dtype=torch.bfloat16), _randn(3, 8, seed=1)
    slot_mapping = torch.tensor([7, 22, PAD_SLOT])
    expected = cache.clone()
    torch.ops.metrale.store_latents(expected, latents, slot_mapping)

    torch.ops.metrale_native.store_latents(cache, latents, slot_mapping)

    assert torch.equal(cache, expected)
    assert cache.view(-1, 8)[22].abs().sum() > 0


@pytest.mark.parametrize("slot", [SLOTS, -2])
def test_native_ops_refuse_a_slot_outside_the_pool(slot: int) -> None:
    assert native_graph_ops.load()
    states, weight, x = _randn(SLOTS, D, W - 1, seed=0), _randn(D, W, seed=1), _randn(2, D, seed=2)
    before = states.clone()

    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.metrale_native.causal_conv1d_update(x, weight, states, torch.tensor([0, slot]))

    assert torch.equal(states, before)


@pytest.mark.parametrize("real", [1, 3, 4], ids=lambda n: f"{n}of4real")
def test_gdn_decode_runs_the_real_rows_and_leaves_every_other_slot(real: int) -> None:
    """Two value heads share one key head; the padding rows' inputs are garbage that must not matter."""
    pool = _randn(SLOTS, 2, K, D, seed=0)
    slots = torch.tensor([4, 1, 2, 0][:real] + [PAD_SLOT] * (4 - real))
    q, k = (torch.nn.functional.normalize(_randn(4, 1, K, seed=s), dim=-1) for s in (1, 2))
    v, log_decay, beta = _randn(4, 2, D, seed=3), -_randn(4, 2, seed=4).abs(), _randn(4, 2, seed=5).sigmoid()
    expected_pool = pool.clone()
    rows = slice(0, real)
    expected = ops.gdn_decode(q[rows], k[rows], v[rows], log_decay[rows], beta[rows], expected_pool, slots[rows], 0.5)

    got = torch.ops.metrale.gdn_decode(q, k, v, log_decay, beta, pool, slots, 0.5)

    assert torch.equal(got[:real], expected)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    assert torch.equal(pool, expected_pool)


def test_a_traced_gdn_decode_is_the_custom_op_and_gives_the_eager_bits() -> None:
    pool = _randn(SLOTS, 2, K, D, seed=6)
    slots = torch.tensor([3, 5])
    q, k = (torch.nn.functional.normalize(_randn(2, 2, K, seed=s), dim=-1) for s in (7, 8))
    v, log_decay, beta = _randn(2, 2, D, seed=9), -_randn(2, 2, seed=10).abs(), _randn(2, 2, seed=11).sigmoid()
    eager_pool = pool.clone()
    eager = ops.gdn_decode(q, k, v, log_decay, beta, eager_pool, slots, 0.25)

    traced = torch.compile(ops.gdn_decode, backend="eager", fullgraph=True)
    got = traced(q, k, v, log_decay, beta, pool, slots, 0.25)

    assert torch.equal(got, eager)
    assert torch.equal(pool, eager_pool)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("real", [1, 3, 4], ids=lambda n: f"{n}of4real")
def test_native_mla_decode_latent_is_the_c_kernel_on_the_real_rows(real: int, cache_dtype: torch.dtype) -> None:
    """The graph's MLA attention op gives each real row what the eager C kernel gives it (the same kernel:
    the same bits), zeros for the padding rows (context 0, garbage queries, tables of block 0)."""
    assert native_graph_ops.load()
    heads, kv_rank, rope_dim, block_size, blocks = 2, 16, 4, 4, 80
    cache = _randn(blocks, block_size, kv_rank + rope_dim, seed=0).to(cache_dtype)
    lengths = torch.tensor([9, 1, 300, 17][:real] + [0] * (4 - real))  # 300: two of the kernel's 256-spans
    generator = torch.Generator().manual_seed(3)
    tables = torch.stack([torch.randperm(blocks, generator=generator) for _ in range(4)])  # shuffled pages
    tables[real:] = 0
    q_latent, q_rope = _randn(4, heads, kv_rank, seed=1), _randn(4, heads, rope_dim, seed=2)
    rows = slice(0, real)
    expected = native_mla.attend_single_rows(q_latent[rows], q_rope[rows], cache, tables[rows], lengths[rows], 0.3)

    got = torch.ops.metrale_native.mla_decode_latent(q_latent, q_rope, cache, tables, lengths, 0.3)

    assert torch.equal(got[:real], expected)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))


def test_native_mla_decode_latent_refuses_a_block_outside_the_cache() -> None:
    assert native_graph_ops.load()
    cache = _randn(6, 4, 20, seed=0)
    tables = torch.tensor([[0, 1], [2, 6]])

    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.metrale_native.mla_decode_latent(
            _randn(2, 2, 16, seed=1), _randn(2, 2, 4, seed=2), cache, tables, torch.tensor([5, 6]), 0.3
        )
