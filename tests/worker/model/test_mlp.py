"""The routed mixture of experts against a token-by-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.worker.model.config import ModelConfig
from metrale.worker.model.layers import mlp
from metrale.worker.model.layers.mlp import MoE
from metrale.worker.model.tiny import tiny_config_dict


def _moe(seed: int) -> MoE:
    moe = MoE(ModelConfig.from_hf_dict(tiny_config_dict(vocab_size=32)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return moe


def _token_by_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """``sum_j w_j expert_{id_j}(x_n) + shared(x_n)``, one token and one expert at a time."""
    ids, weights = moe.route(x)
    rows = []
    for n in range(x.shape[0]):
        row = torch.zeros_like(x[n])
        for expert, weight in zip(ids[n].tolist(), weights[n], strict=True):
            gate, up = F.linear(x[n], moe.experts_gate_up[expert]).chunk(2)
            row += weight * F.linear(F.silu(gate) * up, moe.experts_down[expert])
        rows.append(row if moe.shared is None else row + moe.shared(x[n]))
    return torch.stack(rows)


@pytest.mark.parametrize("tokens", [1, 5, 64, 700], ids=lambda n: f"{n}tokens")
@pytest.mark.parametrize(
    "padded_pairs", [(0, 0), (0, 10**6), (1, 512)], ids=["expert-runs", "padded-batched", "default"]
)
def test_moe_matches_token_by_token_reference(
    tokens: int, padded_pairs: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mlp, "PADDED_EXPERTS_MIN_PAIRS_PER_EXPERT", padded_pairs[0])
    monkeypatch.setattr(mlp, "PADDED_EXPERTS_MAX_PAIRS", padded_pairs[1])
    moe = _moe(seed=tokens)
    x = torch.randn(tokens, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(100 + tokens))

    with torch.no_grad():
        got, expected = moe(x), _token_by_token(moe, x)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_one_row_path_is_bitwise_the_batched_path(dtype: torch.dtype, seed: int) -> None:
    """A decode step of one stream takes ``_one_row_experts``; it must equal ``_routed_experts`` exactly."""
    moe = _moe(seed=seed).to(dtype)
    x = torch.randn(1, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(seed)).to(dtype)
    with torch.no_grad():
        ids, weights = moe.route(x)
        assert torch.equal(moe._one_row_experts(x, ids, weights), moe._routed_experts(x, ids, weights))


def test_routing_with_every_group_kept_is_a_plain_top_k() -> None:
    """``topk_group == num_groups`` (Kimi's release: one group) skips the group mask; the choice is then
    the top-k of the biased scores."""
    moe = _moe(seed=5)
    moe.topk_group = moe.num_groups
    x = torch.randn(32, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ids, _ = moe.route(x)
        choice = F.linear(x, moe.router_weight).sigmoid() + moe.router_bias
    assert torch.equal(ids.sort().values, choice.topk(moe.top_k).indices.sort().values)


@pytest.mark.parametrize("tokens", [1, 3, 8], ids=lambda n: f"{n}tokens")
def test_gathered_experts_match_the_routed_experts(tokens: int) -> None:
    """The compiled decode step's static-shape experts (run eagerly here) against the batched path: equal
    to rounding (the products sum in another order). An output is a sum of 2 × 512-term products with
    terms up to ~1, so reordering moves it by a few 1e-6 however small it is (2.4e-6 seen with MKL on an
    AVX-512 Xeon): the absolute tolerance is 1e-5."""
    moe = _moe(seed=10 + tokens)
    x = torch.randn(tokens, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        ids, weights = moe.route(x)
        got, expected = moe._gathered_experts(x, ids, weights), moe._routed_experts(x, ids, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
