"""exp.h's vectorizable exp (the SiLU of the C conv, the KDA decay) against exp in float64."""

from __future__ import annotations

import math

import torch

from metrale.worker.kernels.native.library import native_library


def _met_exp(x: torch.Tensor) -> torch.Tensor:
    library = native_library()
    assert library is not None
    x = x.contiguous()
    y = torch.empty_like(x)
    library.met_exp(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def _ulps(value: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|value - exact| in units of the float32 spacing at ``exact``."""
    nearest = exact.float()
    spacing = (torch.nextafter(nearest.abs(), torch.tensor(math.inf)) - nearest.abs()).double()
    return (value.double() - exact).abs() / spacing


def test_exp_is_within_two_ulps_over_the_float_range_it_serves() -> None:
    x = torch.linspace(-87.0, 88.0, 2_000_003, dtype=torch.float32)
    assert float(_ulps(_met_exp(x), torch.exp(x.double())).max()) <= 2.0


def test_exp_clamps_instead_of_overflowing() -> None:
    y = _met_exp(torch.tensor([-1e4, -200.0, 200.0, 1e4]))
    assert bool(torch.isfinite(y).all()) and bool((y > 0).all())
    assert float(y[0]) < 1e-37 and float(y[-1]) > 1e38


def test_each_element_gets_the_same_bits_alone_or_in_a_vectorized_run() -> None:
    x = torch.randn(1_003, generator=torch.Generator().manual_seed(0)) * 20
    together = _met_exp(x)
    alone = torch.cat([_met_exp(x[i : i + 1]) for i in range(x.numel())])
    assert torch.equal(together, alone)
