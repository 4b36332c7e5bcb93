"""bf16 products widened to fp32 on CPUs without bf16 instructions, and left alone elsewhere; every CPU
product batch-invariant (a row's bits do not depend on the other rows): decode rows through the one-order
C product, batch rows padded to a multiple of ROW_BLOCK; which rows are which, by forward and by caller."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from metrale.worker.kernels import products
from metrale.worker.kernels.native import product as native_product
from metrale.worker.kernels.products import BF16_MATMUL_FLAGS, bmm, cpu_multiplies_bf16, einsum, linear
from metrale.worker.model.layers.linear import Linear


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_the_cpu_is_read_from_its_flags() -> None:
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    assert cpu_multiplies_bf16() == any(flag in flags.split() for flag in BF16_MATMUL_FLAGS)
    assert products.WIDEN_BF16 is not cpu_multiplies_bf16()


def test_widened_bf16_products_are_fp32_products_rounded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(products, "WIDEN_BF16", True)
    x, weight = _bf16(16, 64, seed=1), _bf16(48, 64, seed=2)
    batched_x, batched_w = _bf16(3, 5, 64, seed=3), _bf16(3, 64, 32, seed=4)

    widened = linear(x, weight)
    widened_bmm = bmm(batched_x, batched_w)

    assert widened.dtype == widened_bmm.dtype == torch.bfloat16
    assert torch.equal(widened, F.linear(x.float(), weight.float()).bfloat16())
    assert torch.equal(widened_bmm, torch.bmm(batched_x.float(), batched_w.float()).bfloat16())
    torch.testing.assert_close(widened, F.linear(x, weight), rtol=1e-2, atol=1e-2)  # native, another order


def test_widened_einsum_is_the_fp32_einsum_rounded_once_and_fp32_is_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    q, latents = _bf16(6, 4, 32, seed=9), _bf16(4, 32, 16, seed=10)  # MLA's "nhd,hdc->nhc"
    monkeypatch.setattr(products, "WIDEN_BF16", True)
    widened = einsum("nhd,hdc->nhc", q, latents)
    assert widened.dtype == torch.bfloat16
    assert torch.equal(widened, torch.einsum("nhd,hdc->nhc", q.float(), latents.float()).bfloat16())
    torch.testing.assert_close(widened, torch.einsum("nhd,hdc->nhc", q, latents), rtol=1e-2, atol=1e-2)
    assert torch.equal(
        einsum("nhd,hdc->nhc", q.float(), latents.float()), torch.einsum("nhd,hdc->nhc", q.float(), latents.float())
    )
    monkeypatch.setattr(products, "WIDEN_BF16", False)
    assert torch.equal(einsum("nhd,hdc->nhc", q, latents), torch.einsum("nhd,hdc->nhc", q, latents))


def test_batch_rows_keep_torch_s_product(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = _bf16(48, 64, seed=6)
    rows = _bf16(8, 64, seed=7)  # a multiple of ROW_BLOCK: nothing padded
    monkeypatch.setattr(products, "WIDEN_BF16", True)
    assert torch.equal(linear(rows.float(), weight.float()), F.linear(rows.float(), weight.float()))
    monkeypatch.setattr(products, "WIDEN_BF16", False)
    assert torch.equal(linear(rows, weight), F.linear(rows, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_take_the_one_order_product_rounded_once(dtype: torch.dtype) -> None:
    """A lone row outside a forward, and every row of a decode forward: ``native.product`` in fp32, rounded
    to the rows' dtype once — close to torch's product, and the same bits alone as in any batch."""
    weight, x = _bf16(96, 256, seed=21).to(dtype), _bf16(12, 256, seed=22).to(dtype)
    one_order = native_product.product(x.float()[None], weight[None])[0].to(dtype)
    alone = torch.cat([linear(x[m : m + 1], weight) for m in range(12)])
    assert alone.dtype == dtype and torch.equal(alone, one_order)
    torch.testing.assert_close(alone.float(), F.linear(x.float(), weight.float()), rtol=1e-2, atol=1e-2)
    with products.forward_rows(12, 12, torch.arange(12)):
        assert torch.equal(linear(x, weight), one_order)
        assert torch.equal(linear(x[3:8], weight), one_order[3:8])  # a decode forward: every product
    with products.rows_of_kind(decode=True):
        assert torch.equal(bmm(x[None, 2:9], weight.T[None]), one_order[None, 2:9])
        assert torch.equal(products.heads_product(x[:5, None], weight.T[None]), one_order[:5, None])


def test_a_mixed_forward_splits_its_rows_by_kind() -> None:
    """Decode rows first (the executor's layout): they take the one-order product, the prefill rows after
    them the padded batch product, as in a forward of their own kind."""
    weight, x = _bf16(96, 256, seed=23).float(), _bf16(11, 256, seed=24).float()
    decode_alone = torch.cat([linear(x[m : m + 1], weight) for m in range(3)])
    with products.forward_rows(11, 0, torch.tensor([4, 10])):
        prefill_alone = linear(x[3:], weight)
    logit_rows = torch.tensor([0, 1, 2, 6, 10])
    with products.forward_rows(11, 3, logit_rows):
        mixed = linear(x, weight)
        head = linear(x[logit_rows], weight)  # the LM head's rows: the decode rows first
        assert products.decode_rows(7) == 0  # rows no caller classified: batch rows
    assert torch.equal(mixed[:3], decode_alone) and torch.equal(mixed[3:], prefill_alone)
    assert torch.equal(head[:3], decode_alone) and torch.equal(head[3:], prefill_alone[[3, 7]])


def test_rows_read_in_the_callers_order_are_batch_rows_to_the_head() -> None:
    with products.forward_rows(5, 2, torch.tensor([4, 0, 1])):
        assert products.decode_rows(3) == 0
    with products.forward_rows(5, 5, torch.tensor([4, 0, 1])):
        assert products.decode_rows(3) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_s_product_is_the_same_bits_whatever_the_other_rows(dtype: torch.dtype, threads: int) -> None:
    """Issue #30: MKL sums a row differently in products of 2, 3 (one thread) or 5–7, 9–11 rows (two)
    than in one of 4, 8, 12…; a bf16 model's hidden state then rounded differently by batch size. One
    row of a batch (``batched``) is padded like the rest; decode rows take the one-order product alone
    and batched."""
    weight, x = _bf16(96, 256, seed=11).to(dtype), _bf16(40, 256, seed=12).to(dtype)
    experts, routed = _bf16(3, 256, 64, seed=13).to(dtype), _bf16(3, 40, 256, seed=14).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        all_rows, all_bmm = linear(x, weight), bmm(routed, experts)
        assert torch.equal(linear(x[:1], weight, batched=True), all_rows[:1])
        for m in range(2, 40):
            assert torch.equal(linear(x[:m], weight), all_rows[:m]), f"{m} rows"
            assert torch.equal(linear(x[m - 2 : m], weight), all_rows[m - 2 : m]), f"rows {m - 2}, {m - 1}"
            assert torch.equal(bmm(routed[:, :m], experts), all_bmm[:, :m]), f"bmm of {m} rows"
        assert torch.equal(linear(x[:3].reshape(3, 1, 256), weight), all_rows[:3].reshape(3, 1, 96))  # any leading dims
        with products.rows_of_kind(decode=True):
            decoded = linear(x, weight)
            for m in (1, 2, 3, 5, 17, 40):
                assert torch.equal(linear(x[m - 1 : m], weight), decoded[m - 1 : m]), f"decode row {m - 1}"
                assert torch.equal(linear(x[:m], weight), decoded[:m]), f"{m} decode rows"
    finally:
        torch.set_num_threads(previous)


def test_the_module_is_a_bias_free_linear_through_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(products, "WIDEN_BF16", True)
    layer = Linear(64, 48).bfloat16()
    x = _bf16(4, 64, seed=8)

    assert layer.bias is None
    assert torch.equal(layer(x), F.linear(x.float(), layer.weight.float()).bfloat16())
