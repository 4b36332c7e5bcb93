"""The routed mixture of experts against a token-by-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.worker.model import mlp
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.mlp import MoE
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
