from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm, KimiLinearRMSNormGated

from metrale.worker.kernels.norm import fused_gated_rms_norm, fused_rms_norm, gated_rms_norm, rms_norm

EPS = 1e-6
SHAPES = [pytest.param((5, 32), id="rows"), pytest.param((2, 3, 4, 16), id="batch-seq-head")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _weight(dim: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return (1.0 + 0.5 * torch.randn(dim, generator=generator)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_transformers(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = (3.0 * torch.randn(shape, generator=generator)).to(dtype)
    weight = _weight(shape[-1], dtype, generator)
    module = KimiLinearRMSNorm(shape[-1], eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        expected = module(x)

    actual = rms_norm(x, weight, EPS)

    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_rms_norm_matches_transformers(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    x = (3.0 * torch.randn(shape, generator=generator)).to(dtype)
    gate = (2.0 * torch.randn(shape, generator=generator)).to(dtype)
    weight = _weight(shape[-1], dtype, generator)
    module = KimiLinearRMSNormGated(shape[-1], eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        expected = module(x, gate)

    actual = gated_rms_norm(x, gate, weight, EPS)

    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_rms_norm_output_has_unit_rms_before_weight() -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 7.0
    normalized = rms_norm(x, torch.ones(64), eps=0.0)
    torch.testing.assert_close(normalized.pow(2).mean(dim=-1), torch.ones(4))


def test_gated_rms_norm_is_halved_by_a_zero_gate() -> None:
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(3, 8, generator=generator), torch.randn(8, generator=generator)
    gated = gated_rms_norm(x, torch.zeros(3, 8), weight, EPS)
    torch.testing.assert_close(gated, 0.5 * rms_norm(x, weight, EPS))


FUSED_SHAPES = [(1, 512), (3, 512), (1, 4, 128), (7, 160), (130, 512), (1, 2048)]


@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seed", range(5))
def test_fused_fp32_norms_are_bitwise_the_references(shape: tuple[int, ...], seed: int) -> None:
    """On the CPU, fp32 norms take torch's fused ``rms_norm``; its numbers must be the reference's."""
    generator = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(shape, generator=generator)
    weight = _weight(shape[-1], torch.float32, generator)
    gate = 2.0 * torch.randn(shape, generator=generator)
    assert torch.equal(fused_rms_norm(x, weight, EPS), rms_norm(x, weight, EPS))
    assert torch.equal(fused_gated_rms_norm(x, gate, weight, EPS), gated_rms_norm(x, gate, weight, EPS))
    # The KDA output norm in a bf16 model: fp32 values, a bf16 gate and weight.
    gate16, weight16 = gate.bfloat16(), weight.bfloat16()
    assert torch.equal(fused_gated_rms_norm(x, gate16, weight16, EPS), gated_rms_norm(x, gate16, weight16, EPS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seed", range(5))
def test_fused_low_precision_norm_is_bitwise_the_reference(
    shape: tuple[int, ...], seed: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = (3.0 * torch.randn(shape, generator=generator)).to(dtype)
    weight = _weight(shape[-1], dtype, generator)
    assert torch.equal(fused_rms_norm(x, weight, EPS), rms_norm(x, weight, EPS))
    assert torch.equal(fused_rms_norm(x.float(), weight, EPS), rms_norm(x.float(), weight, EPS))  # fp32 x, low weight
