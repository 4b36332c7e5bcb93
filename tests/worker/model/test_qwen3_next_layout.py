"""Qwen3-Next's fused projections split into Qwen3.5's, against transformers' own split."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from metrale.worker.model.families.qwen3_next_layout import (
    LinearAttentionHeads,
    fuse_in_proj_ba,
    fuse_in_proj_qkvz,
    is_full_attention,
    split_in_proj_ba,
    split_in_proj_qkvz,
)

HEAD_LAYOUTS = {  # (key heads, value heads, key dim, value dim)
    "hk2-hv2": (2, 2, 8, 8),
    "hk2-hv4": (2, 4, 8, 8),
    "hk3-hv6-k4-v6": (3, 6, 4, 6),
    "release-16-32-128": (16, 32, 128, 128),
}


def _hf_layer(hk: int, hv: int, k: int, v: int, hidden: int = 24) -> Qwen3NextGatedDeltaNet:
    config = Qwen3NextConfig(
        hidden_size=hidden,
        num_hidden_layers=4,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=k,
        linear_value_head_dim=v,
    )
    torch.manual_seed(hk * 100 + hv)
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_split_weights_give_transformers_q_k_v_z_b_a(layout: str) -> None:
    """transformers projects with the fused weights and un-interleaves the outputs; our split weights
    must project straight to the same q, k, v, z, b, a (bit for bit: the inputs are the identity, so each
    output is a weight column, untouched by rounding)."""
    hk, hv, k, v = HEAD_LAYOUTS[layout]
    layer = _hf_layer(hk, hv, k, v)
    heads = LinearAttentionHeads(hk, hv, k, v)
    qkvz, ba = layer.in_proj_qkvz.weight.detach(), layer.in_proj_ba.weight.detach()
    # Each of the D "tokens" is one input unit: its projection is one column of each weight.
    q, key, value, z, b, a = layer.fix_query_key_value_ordering(qkvz.T.unsqueeze(0), ba.T.unsqueeze(0))

    qkv_w, z_w = split_in_proj_qkvz(qkvz, heads)
    b_w, a_w = split_in_proj_ba(ba, heads)

    ours_q, ours_k, ours_v = qkv_w.T.split([heads.key_dim, heads.key_dim, heads.value_dim], dim=-1)
    assert torch.equal(ours_q, q.flatten(2)[0])
    assert torch.equal(ours_k, key.flatten(2)[0])
    assert torch.equal(ours_v, value.flatten(2)[0])
    assert torch.equal(z_w.T, z.flatten(2)[0])
    assert torch.equal(b_w.T, b[0])
    assert torch.equal(a_w.T, a[0])
    assert qkv_w.shape == (2 * hk * k + hv * v, qkvz.shape[1])


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_fusing_inverts_splitting(layout: str) -> None:
    hk, hv, k, v = HEAD_LAYOUTS[layout]
    heads = LinearAttentionHeads(hk, hv, k, v)
    qkvz = torch.randn(hk * (2 * k + 2 * (hv // hk) * v), 5)
    ba = torch.randn(2 * hv, 5)
    assert torch.equal(fuse_in_proj_qkvz(*split_in_proj_qkvz(qkvz, heads), heads), qkvz)
    assert torch.equal(fuse_in_proj_ba(*split_in_proj_ba(ba, heads), heads), ba)


def test_value_heads_must_be_a_multiple_of_key_heads() -> None:
    with pytest.raises(ValueError, match="linear_num_value_heads=6 is not a multiple of linear_num_key_heads=4"):
        LinearAttentionHeads(4, 6, 8, 8)


@pytest.mark.parametrize("layers", [4, 8, 13, 48])
def test_every_fourth_layer_is_full_attention_as_transformers_says(layers: int) -> None:
    expected = Qwen3NextConfig(num_hidden_layers=layers).layer_types
    assert ["full_attention" if is_full_attention(i) else "linear_attention" for i in range(layers)] == expected
