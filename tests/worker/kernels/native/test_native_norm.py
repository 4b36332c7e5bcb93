"""The C RMS norms against transformers' modules, and the properties the engine relies on: a row's result
is bitwise the same alone or in any batch and at any thread count (so a token's norm does not depend on
what it was batched with)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm, KimiLinearRMSNormGated

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import norm, ops
from metrale.worker.kernels.native import norm as native_norm

EPS = 1e-6
TOLERANCE = {"rtol": 2e-6, "atol": 2e-6}
SHAPES = [(1, 512), (64, 512), (256, 128), (7, 100), (3, 5, 33), (2, 16)]


def _inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(shape, generator=generator)
    gate = 2.0 * torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    return x, gate, weight


@pytest.fixture
def backend() -> Iterator[None]:
    previous = ops.kernel_backend()
    yield
    ops.set_kernel_backend(previous)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_matches_transformers(shape: tuple[int, ...]) -> None:
    x, _, weight = _inputs(shape, seed=0)
    module = KimiLinearRMSNorm(shape[-1], eps=EPS)
    with torch.no_grad():
        module.weight.copy_(weight)
        expected = module(x)

    assert native_norm.supports(x, weight)
    torch.testing.assert_close(native_norm.rms_norm(x, weight, EPS), expected, **TOLERANCE)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gated_rms_norm_matches_transformers(shape: tuple[int, ...]) -> None:
    x, gate, weight = _inputs(shape, seed=1)
    module = KimiLinearRMSNormGated(shape[-1], eps=EPS)
    with torch.no_grad():
        module.weight.copy_(weight)
        expected = module(x, gate)

    assert native_norm.supports(x, weight, gate)
    torch.testing.assert_close(native_norm.gated_rms_norm(x, gate, weight, EPS), expected, **TOLERANCE)


def test_rows_of_a_wider_tensor_are_read_in_place() -> None:
    """A norm's input may be a column slice of a fused projection (rows further apart than ``D``)."""
    fused, gate, weight = _inputs((9, 3 * 64), seed=2)
    x, g = fused[:, 64:128], gate[:, :64]
    assert native_norm.supports(x, weight[:64], g)
    assert torch.equal(
        native_norm.rms_norm(x, weight[:64], EPS), native_norm.rms_norm(x.contiguous(), weight[:64], EPS)
    )
    assert torch.equal(
        native_norm.gated_rms_norm(x, g, weight[:64], EPS),
        native_norm.gated_rms_norm(x.contiguous(), g.contiguous(), weight[:64], EPS),
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_is_the_same_alone_in_any_batch_and_at_any_thread_count(threads: int) -> None:
    x, gate, weight = _inputs((512, 512), seed=3)  # above the size that spreads rows over threads
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = native_norm.rms_norm(x, weight, EPS)
        gated = native_norm.gated_rms_norm(x, gate, weight, EPS)
    finally:
        torch.set_num_threads(previous)
    for row in (0, 17, 511):
        assert torch.equal(batch[row], native_norm.rms_norm(x[row : row + 1], weight, EPS)[0])
        assert torch.equal(
            gated[row], native_norm.gated_rms_norm(x[row : row + 1], gate[row : row + 1], weight, EPS)[0]
        )


def test_a_zero_gate_halves_the_norm() -> None:
    x, _, weight = _inputs((5, 64), seed=4)
    torch.testing.assert_close(
        native_norm.gated_rms_norm(x, torch.zeros(5, 64), weight, EPS), 0.5 * native_norm.rms_norm(x, weight, EPS)
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_rms_norm_matches_transformers(shape: tuple[int, ...]) -> None:
    """A bf16 model's layer norm: transformers' module in bf16 (the normalised value rounded to bf16, then
    times the bf16 weight); the C kernel's sum of squares runs in another order, so an element may land
    one bf16 rounding away, and only rarely."""
    x, _, weight = (t.bfloat16() for t in _inputs(shape, seed=7))
    module = KimiLinearRMSNorm(shape[-1], eps=EPS).bfloat16()
    with torch.no_grad():
        module.weight.copy_(weight)
        expected = module(x)

    assert native_norm.supports(x, weight)
    got = native_norm.rms_norm(x, weight, EPS)

    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-6)
    assert (got != expected).float().mean() < 0.02


def test_bf16_rows_get_the_same_bits_alone_and_batched() -> None:
    x, _, weight = (t.bfloat16() for t in _inputs((64, 512), seed=8))
    batch = native_norm.rms_norm(x, weight, EPS)
    for row in (0, 17, 63):
        assert torch.equal(batch[row], native_norm.rms_norm(x[row : row + 1], weight, EPS)[0])


def test_other_dtypes_are_not_taken() -> None:
    x, gate, weight = _inputs((4, 32), seed=5)
    assert not native_norm.supports(x.bfloat16(), weight)
    assert not native_norm.supports(x.bfloat16(), weight.bfloat16(), gate.bfloat16())
    assert not native_norm.supports(x, weight, gate.bfloat16())
    assert not native_norm.supports(x.half(), weight.half())
    assert not native_norm.supports(x, weight[:16])


@pytest.mark.usefixtures("backend")
def test_ops_take_the_c_norms_on_the_cpu_and_the_references_under_the_torch_backend() -> None:
    x, gate, weight = _inputs((6, 128), seed=6)
    ops.set_kernel_backend(KernelBackend.AUTO)
    assert torch.equal(ops.rms_norm(x, weight, EPS), native_norm.rms_norm(x, weight, EPS))
    assert torch.equal(ops.gated_rms_norm(x, gate, weight, EPS), native_norm.gated_rms_norm(x, gate, weight, EPS))
    x16, weight16 = x.bfloat16(), weight.bfloat16()
    assert torch.equal(ops.rms_norm(x16, weight16, EPS), native_norm.rms_norm(x16, weight16, EPS))

    ops.set_kernel_backend(KernelBackend.TORCH)
    assert torch.equal(ops.rms_norm(x, weight, EPS), norm.rms_norm(x, weight, EPS))
    assert torch.equal(ops.rms_norm(x16, weight16, EPS), norm.rms_norm(x16, weight16, EPS))
    assert torch.equal(ops.gated_rms_norm(x, gate, weight, EPS), norm.gated_rms_norm(x, gate, weight, EPS))
