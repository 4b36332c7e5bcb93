"""The C mixture-of-experts blocks over decode rows (``native.router``, ``native.swiglu``) against
transformers' Kimi-Linear MoE and MLP, against their torch twins in ``layers.mlp``, and the property the
engine relies on: a decode row's result is bitwise the same alone and among any other decode rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMLP, KimiLinearMoE

from metrale.worker.kernels.native import router as native_router
from metrale.worker.kernels.native import swiglu as native_swiglu
from metrale.worker.kernels.products import rows_of_kind
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.layers.mlp import DenseMLP, MoE
from metrale.worker.model.tiny import tiny_config_dict

HIDDEN, INTERMEDIATE = 64, 48


def _config(**overrides: Any) -> ModelConfig:
    fields = {**tiny_config_dict(vocab_size=32), "hidden_size": HIDDEN, "moe_intermediate_size": INTERMEDIATE}
    return ModelConfig.from_hf_dict({**fields, **overrides})


def _moe(seed: int, dtype: torch.dtype = torch.float32, **overrides: Any) -> MoE:
    moe = MoE(_config(**overrides))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return moe.to(dtype)


def _rows(count: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _hf_moe(moe: MoE) -> KimiLinearMoE:
    """transformers' MoE holding ``moe``'s weights (its shared expert's gate and up halves apart)."""
    config = KimiLinearConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=moe.experts_gate_up.shape[0],
        num_experts_per_token=moe.top_k,
        num_shared_experts=1,
        moe_renormalize=moe.renormalize,
        routed_scaling_factor=moe.scaling,
        num_expert_group=moe.num_groups,
        topk_group=moe.topk_group,
    )
    hf = KimiLinearMoE(config).eval()
    assert moe.shared is not None
    gate, up = moe.shared.gate_up.weight.detach().chunk(2)
    with torch.no_grad():
        hf.experts.gate_up_proj.copy_(moe.experts_gate_up)
        hf.experts.down_proj.copy_(moe.experts_down)
        hf.gate.weight.copy_(moe.router_weight)
        hf.gate.e_score_correction_bias.copy_(moe.router_bias)
        hf.shared_experts.gate_proj.weight.copy_(gate)
        hf.shared_experts.up_proj.weight.copy_(up)
        hf.shared_experts.down_proj.weight.copy_(moe.shared.down.weight)
    return hf


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often each C block ran (counted around the real kernels)."""
    counts: dict[str, int] = {}

    def counted(module: Any, name: str) -> None:
        kernel: Callable[..., Any] = getattr(module, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, run)

    counted(native_router, "sigmoid_route")
    counted(native_swiglu, "routed_experts")
    counted(native_swiglu, "swiglu")
    return counts


@pytest.mark.parametrize("rows", [1, 5, 64], ids=lambda n: f"{n}rows")
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "one-group"])
def test_decode_rows_match_transformers_moe(rows: int, grouped: bool, calls: dict[str, int]) -> None:
    moe = _moe(seed=rows, **({} if grouped else {"num_expert_group": 1, "topk_group": 1}))
    x = _rows(rows, seed=rows)
    with torch.no_grad(), rows_of_kind(decode=True):
        got = moe(x)
        expected = _hf_moe(moe)(x)
    assert calls == {"sigmoid_route": 1, "routed_experts": 1, "swiglu": 1}
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_dense_decode_rows_match_transformers_mlp(calls: dict[str, int]) -> None:
    mlp = DenseMLP(HIDDEN, INTERMEDIATE)
    hf = KimiLinearMLP(KimiLinearConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
        gate, up = mlp.gate_up.weight.chunk(2)
        hf.gate_proj.weight.copy_(gate)
        hf.up_proj.weight.copy_(up)
        hf.down_proj.weight.copy_(mlp.down.weight)
        x = _rows(9, seed=7)
        with rows_of_kind(decode=True):
            got = mlp(x)
        torch.testing.assert_close(got, hf(x), rtol=1e-5, atol=1e-5)
    assert calls == {"swiglu": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_decode_row_is_the_same_bits_alone_and_among_others(dtype: torch.dtype) -> None:
    moe = _moe(seed=11, dtype=dtype)
    x = _rows(64, seed=11, dtype=dtype)
    with torch.no_grad(), rows_of_kind(decode=True):
        together = moe(x)
        for row in (0, 17, 63):
            assert torch.equal(moe(x[row : row + 1]), together[row : row + 1]), row


def test_bf16_decode_rows_round_like_the_torch_twin() -> None:
    """A bf16 model's C blocks round where the twin's bf16 tensors do: within bf16's rounding of it
    (taking fp32 intermediates instead would be further off)."""
    moe = _moe(seed=3, dtype=torch.bfloat16)
    x = _rows(32, seed=3, dtype=torch.bfloat16)
    with torch.no_grad(), rows_of_kind(decode=True):
        got = moe(x)
        ids, weights = moe.plain_route(x)
        assert moe.shared is not None
        twin = (moe._routed_experts(x, ids, weights) + moe.shared.plain(x)).float()
    torch.testing.assert_close(got.float(), twin, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("top_k", [1, 2, 3, 6])
@pytest.mark.parametrize("groups", [(1, 1), (2, 1), (4, 2)], ids=lambda g: f"{g[0]}groups-keep{g[1]}")
def test_router_chooses_as_the_torch_route(top_k: int, groups: tuple[int, int]) -> None:
    """The same experts; the same weights bit for bit up to two experts a row (a sum of two does not
    depend on its order), to rounding beyond."""
    moe = _moe(
        seed=top_k, num_experts=16, num_experts_per_token=top_k, num_expert_group=groups[0], topk_group=groups[1]
    )
    x = _rows(40, seed=top_k)
    with torch.no_grad(), rows_of_kind(decode=True):  # the twin's scores through the same one-order product
        expected_ids, expected_weights = moe.plain_route(x)
        ids, weights = native_router.sigmoid_route(
            x,
            moe.router_weight,
            moe.router_bias,
            num_groups=moe.num_groups,
            topk_group=moe.topk_group,
            top_k=top_k,
            renormalize=moe.renormalize,
            scaling=moe.scaling,
        )
    order = expected_ids.argsort(dim=-1)
    assert torch.equal(ids, expected_ids.gather(1, order))
    in_order = expected_weights.gather(1, order)
    if top_k <= 2:
        assert torch.equal(weights, in_order)
    else:
        torch.testing.assert_close(weights, in_order, rtol=1e-6, atol=1e-7)


def test_router_breaks_ties_toward_the_lower_expert() -> None:
    """Every score equal (a zero router and bias): the lowest ids of the first kept group."""
    moe = _moe(seed=0, num_experts=8, num_experts_per_token=2, num_expert_group=2, topk_group=1)
    with torch.no_grad():
        moe.router_weight.zero_()
        moe.router_bias.zero_()
        ids, weights = native_router.sigmoid_route(
            _rows(3, seed=0),
            moe.router_weight,
            moe.router_bias,
            num_groups=2,
            topk_group=1,
            top_k=2,
            renormalize=True,
            scaling=2.0,
        )
    assert ids.tolist() == [[0, 1]] * 3
    assert torch.equal(weights, torch.ones(3, 2))


def test_an_expert_id_out_of_range_is_refused() -> None:
    moe = _moe(seed=0)
    x = _rows(2, seed=0)
    ids = torch.tensor([[0, 1], [2, moe.experts_gate_up.shape[0]]])
    with pytest.raises(IndexError, match="outside"):
        native_swiglu.routed_experts(x, ids, torch.ones(2, 2), moe.experts_gate_up, moe.experts_down)
