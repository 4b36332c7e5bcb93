"""bf16 products widened to fp32 on CPUs without bf16 instructions, and left alone elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from metrale.worker.kernels import products
from metrale.worker.kernels.products import BF16_MATMUL_FLAGS, bmm, cpu_multiplies_bf16, einsum, linear
from metrale.worker.model.linear import Linear


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


def test_one_row_fp32_and_cpus_with_bf16_instructions_keep_torch_s_product(monkeypatch: pytest.MonkeyPatch) -> None:
    one_row, weight = _bf16(1, 64, seed=5), _bf16(48, 64, seed=6)
    rows = _bf16(8, 64, seed=7)
    monkeypatch.setattr(products, "WIDEN_BF16", True)
    assert torch.equal(linear(one_row, weight), F.linear(one_row, weight))
    assert torch.equal(linear(rows.float(), weight.float()), F.linear(rows.float(), weight.float()))
    monkeypatch.setattr(products, "WIDEN_BF16", False)
    assert torch.equal(linear(rows, weight), F.linear(rows, weight))


def test_the_module_is_a_bias_free_linear_through_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(products, "WIDEN_BF16", True)
    layer = Linear(64, 48).bfloat16()
    x = _bf16(4, 64, seed=8)

    assert layer.bias is None
    assert torch.equal(layer(x), F.linear(x.float(), layer.weight.float()).bfloat16())
