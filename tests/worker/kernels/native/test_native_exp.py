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


LIMIT = 40.0  # exp.h's MET_EXP_LIMIT


def test_exp_is_within_two_ulps_over_the_range_it_serves() -> None:
    x = torch.linspace(-LIMIT, LIMIT, 2_000_003, dtype=torch.float32)
    assert float(_ulps(_met_exp(x), torch.exp(x.double())).max()) <= 2.0


def test_exp_clamps_to_its_range_and_stays_a_normal_float() -> None:
    """Beyond +-40 the result is exp(+-40): finite, and far from the denormals (see exp.h)."""
    y = _met_exp(torch.tensor([-1e4, -200.0, -40.5, 40.5, 200.0, 1e4]))
    edges = _met_exp(torch.tensor([-LIMIT, LIMIT]))
    assert torch.equal(y[:3], edges[0].expand(3)) and torch.equal(y[3:], edges[1].expand(3))
    assert 1e-18 < float(edges[0]) < 1e-17 and 1e17 < float(edges[1]) < 1e18


def test_each_element_gets_the_same_bits_alone_or_in_a_vectorized_run() -> None:
    x = torch.randn(1_003, generator=torch.Generator().manual_seed(0)) * 20
    together = _met_exp(x)
    alone = torch.cat([_met_exp(x[i : i + 1]) for i in range(x.numel())])
    assert torch.equal(together, alone)
