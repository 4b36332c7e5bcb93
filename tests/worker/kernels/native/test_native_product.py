"""The C products with one summation order (``product.c``) against the products in float64, and a row's
bits the same whatever the row count, the rows around it and the thread count; the sigmoid beside them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from metrale.worker.kernels.native import product as native_product

DEPTHS = (1, 7, 8, 9, 64, 77, 256)
"""``K``: below, at and past one vector of the fixed order's 8 lanes, and with a tail."""


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("depth", DEPTHS)
def test_products_equal_float64_products_to_fp32_rounding(dtype: torch.dtype, depth: int) -> None:
    x = _randn(3, 13, depth, seed=1)
    weight, weight_kn = _randn(3, 10, depth, seed=2, dtype=dtype), _randn(3, depth, 10, seed=3, dtype=dtype)
    exact = torch.einsum("gmk,gnk->gmn", x.double(), weight.double())
    exact_kn = torch.einsum("gmk,gkn->gmn", x.double(), weight_kn.double())
    tolerance = 4e-7 * depth**0.5 * 4  # fp32 sums of depth terms of size ~1
    torch.testing.assert_close(native_product.product(x, weight).double(), exact, rtol=1e-5, atol=tolerance)
    torch.testing.assert_close(native_product.product_kn(x, weight_kn).double(), exact_kn, rtol=1e-5, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vector_code_and_the_portable_code_give_the_same_bits(dtype: torch.dtype, threads: int) -> None:
    for depth in (*DEPTHS, 2048):
        x, weight = _randn(2, 9, depth, seed=depth), _randn(2, 17, depth, seed=depth + 1, dtype=dtype)
        assert torch.equal(native_product.product(x, weight), native_product.product(x, weight, portable=True)), depth
        for outputs in (1, 3, 17, 1030):  # a lone row: weight rows read in streams far apart, any remainder
            lone, weight = x[:, :1], _randn(2, outputs, depth, seed=depth + 2, dtype=dtype)
            vector, portable = native_product.product(lone, weight), native_product.product(lone, weight, portable=True)
            assert torch.equal(vector, portable), (depth, outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_s_result_is_the_same_bits_in_products_of_any_row_count(dtype: torch.dtype, threads: int) -> None:
    """Issue #30: a lone decode row (1 row) and the same row among 1..70 others, at any offset."""
    x = _randn(1, 70, 384, seed=4)
    weight, weight_kn = _randn(1, 200, 384, seed=5, dtype=dtype), _randn(1, 384, 200, seed=6, dtype=dtype)
    alone = torch.cat([native_product.product(x[:, m : m + 1], weight) for m in range(70)], dim=1)
    alone_kn = torch.cat([native_product.product_kn(x[:, m : m + 1], weight_kn) for m in range(70)], dim=1)
    for start, stop in ((0, 70), (0, 2), (3, 6), (5, 12), (9, 64), (1, 70)):
        assert torch.equal(native_product.product(x[:, start:stop], weight), alone[:, start:stop]), (start, stop)
        assert torch.equal(native_product.product_kn(x[:, start:stop], weight_kn), alone_kn[:, start:stop])


def test_rows_and_weights_are_read_through_their_strides() -> None:
    x = _randn(4, 6, 40, seed=7)
    weight = _randn(6, 40, 4, seed=8)  # read as [G=4, N=6, K=40] through a permuted view
    out = native_product.product(x, weight.permute(2, 0, 1))
    assert torch.equal(out, native_product.product(x.contiguous(), weight.permute(2, 0, 1).contiguous()))
    rows = _randn(6, 4, 40, seed=9).transpose(0, 1)  # [G, M, K] with rows 4·40 apart
    assert torch.equal(
        native_product.product(rows, weight.permute(2, 0, 1)),
        native_product.product(rows.contiguous(), weight.permute(2, 0, 1)),
    )


def test_shapes_that_do_not_multiply_are_refused() -> None:
    with pytest.raises(ValueError, match="do not multiply"):
        native_product.product(_randn(1, 2, 8, seed=1), _randn(1, 3, 9, seed=2))
    with pytest.raises(ValueError, match="do not multiply"):
        native_product.product_kn(_randn(1, 2, 8, seed=1), _randn(1, 9, 3, seed=2))


def test_the_sigmoid_is_torch_s_to_rounding_and_the_same_bits_at_any_place() -> None:
    x = _randn(4099, seed=10) * 8
    together = native_product.sigmoid(x)
    torch.testing.assert_close(together, torch.sigmoid(x.double()).float(), rtol=4e-7, atol=1e-7)
    alone = torch.cat([native_product.sigmoid(x[i : i + 1]) for i in range(0, 4099, 37)])
    assert torch.equal(alone, together[::37])
    assert torch.equal(native_product.sigmoid(x[5:733]), together[5:733])
