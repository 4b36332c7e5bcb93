"""Qwen's mixture of experts against transformers' own blocks (Qwen3.5 MoE and Qwen3-Next), fp32."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import Qwen3NextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from metrale.worker.model.layers import mlp
from metrale.worker.model.layers.qwen_moe import QwenMoE

SIZES = dict(
    hidden_size=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24
)


def _hf_block(kind: str, norm_topk_prob: bool, seed: int) -> nn.Module:
    if kind == "qwen3_5_moe":
        block: nn.Module = Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(**SIZES))
    else:
        block = Qwen3NextSparseMoeBlock(Qwen3NextConfig(**SIZES, norm_topk_prob=norm_topk_prob))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return block.eval()


def _ours_from(block: Any, norm_topk_prob: bool) -> QwenMoE:
    """Our block holding the same weights (transformers keeps the experts fused 3-D, as we do)."""
    moe = QwenMoE(
        hidden_size=SIZES["hidden_size"],
        num_experts=SIZES["num_experts"],
        top_k=SIZES["num_experts_per_tok"],
        intermediate_size=SIZES["moe_intermediate_size"],
        shared_intermediate_size=SIZES["shared_expert_intermediate_size"],
        norm_topk_prob=norm_topk_prob,
    )
    shared = block.shared_expert
    moe.load_state_dict(
        {
            "router_weight": block.gate.weight,
            "experts_gate_up": block.experts.gate_up_proj,
            "experts_down": block.experts.down_proj,
            "shared.gate_up.weight": torch.cat([shared.gate_proj.weight, shared.up_proj.weight]),
            "shared.down.weight": shared.down_proj.weight,
            "shared_gate.weight": block.shared_expert_gate.weight,
        }
    )
    return moe.eval()


CASES = {  # (transformers block, norm_topk_prob)
    "qwen3_5_moe": ("qwen3_5_moe", True),  # Qwen3.5 MoE always renormalizes
    "qwen3_next-norm": ("qwen3_next", True),
    "qwen3_next-no-norm": ("qwen3_next", False),
}


@pytest.mark.parametrize("tokens", [1, 4, 37, 300], ids=lambda n: f"{n}tokens")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "padded_pairs", [(0, 0), (0, 10**6), (1, 512)], ids=["expert-runs", "padded-batched", "default"]
)
def test_matches_transformers_sparse_moe_block(
    case: str, tokens: int, padded_pairs: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mlp, "PADDED_EXPERTS_MIN_PAIRS_PER_EXPERT", padded_pairs[0])
    monkeypatch.setattr(mlp, "PADDED_EXPERTS_MAX_PAIRS", padded_pairs[1])
    kind, norm = CASES[case]
    block = _hf_block(kind, norm, seed=tokens)
    moe = _ours_from(block, norm)
    x = torch.randn(2, tokens, SIZES["hidden_size"], generator=torch.Generator().manual_seed(7 + tokens))
    with torch.no_grad():
        expected = block(x)
        got = moe(x.reshape(-1, SIZES["hidden_size"])).reshape(x.shape)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_routing_is_transformers_top_k_of_the_softmax() -> None:
    block = _hf_block("qwen3_next", True, seed=3)
    moe = _ours_from(block, True)
    x = torch.randn(64, SIZES["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        ids, weights = moe.route(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)


def test_gathered_and_one_row_paths_match_the_batched_one() -> None:
    """The compiled decode step's static-shape path and one stream's path, run eagerly, against the
    sorted-runs path this block shares with Kimi's MoE."""
    moe = _ours_from(_hf_block("qwen3_5_moe", True, seed=9), True)
    x = torch.randn(5, SIZES["hidden_size"], generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ids, weights = moe.route(x)
        batched = moe._routed_experts(x, ids, weights)
        torch.testing.assert_close(moe._gathered_experts(x, ids, weights), batched, rtol=1e-5, atol=1e-6)
        one_row = moe._one_row_experts(x[:1], ids[:1], weights[:1])
        assert torch.equal(one_row, moe._routed_experts(x[:1], ids[:1], weights[:1]))
