"""Triton RMS norms against the torch references, under the interpreter (fp32 only: see conftest)."""

from __future__ import annotations

import pytest
import torch

from metrale.worker.kernels import norm
from metrale.worker.kernels.triton import norm as triton_norm

pytestmark = pytest.mark.triton

EPS = 1e-6
SHAPES = [
    pytest.param((5, 32), id="rows"),
    pytest.param((2, 3, 24), id="batch-head-unpadded-dim"),
]


def _inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` and ``gate`` of ``shape``, ``weight [D]``."""
    generator = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(shape, generator=generator)
    gate = 2.0 * torch.randn(shape, generator=generator)
    return x, gate, 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_rms_norm_matches_torch(shape: tuple[int, ...]) -> None:
    x, _, weight = _inputs(shape, seed=0)
    torch.testing.assert_close(triton_norm.rms_norm(x, weight, EPS), norm.rms_norm(x, weight, EPS))


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_gated_rms_norm_matches_torch(shape: tuple[int, ...]) -> None:
    x, gate, weight = _inputs(shape, seed=1)
    expected = norm.gated_rms_norm(x, gate, weight, EPS)
    torch.testing.assert_close(triton_norm.gated_rms_norm(x, gate, weight, EPS), expected)


def test_triton_rms_norm_reads_strided_rows() -> None:
    x, _, weight = _inputs((4, 40), seed=2)
    columns = x[:, 8:40]  # a row stride of 40 over 32 used values
    torch.testing.assert_close(
        triton_norm.rms_norm(columns, weight[:32], EPS), norm.rms_norm(columns, weight[:32], EPS)
    )
