"""The Qwen3-Next family (``Qwen3NextForCausalLM``): Qwen3.5's decoder and weight map over a flat checkpoint.

The layers are Qwen3.5 MoE's (transformers 5.23's ``modeling_qwen3_next`` computes the same zero-centred
norms, gated norm, per-head query/gate rows of ``q_proj``, conv and Qwen MoE block; its RoPE is the 1-D
one Qwen3.5's mRoPE reduces to for text); what differs is read by :class:`Qwen3NextConfig` (which layers
run the MoE block, ``norm_topk_prob``) and the checkpoint's layout: tensors under ``model.`` and each
Gated DeltaNet layer's fused ``in_proj_qkvz`` / ``in_proj_ba``, interleaved per key head, which the loader
presents as the Qwen3.5 tensors they hold (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
"""

from __future__ import annotations

from metrale.worker.model.families.family import Family
from metrale.worker.model.families.qwen3_5 import Qwen35Model
from metrale.worker.model.families.qwen3_5_weights import SKIPPED, build_weight_map, canonical_name
from metrale.worker.model.families.qwen3_next_config import Qwen3NextConfig
from metrale.worker.model.families.qwen3_next_layout import (
    LinearAttentionHeads,
    split_in_proj_ba,
    split_in_proj_qkvz,
)
from metrale.worker.model.weight_recipe import FusedTensor, FusedTensors, StoredPart


def linear_attention_heads(config: Qwen3NextConfig) -> LinearAttentionHeads:
    return LinearAttentionHeads(
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )


def fused_tensors(config: Qwen3NextConfig) -> FusedTensors:
    """``layers.N.linear_attn.in_proj_qkvz.weight`` ``[Hk·(2K + 2rV), D]`` → ``in_proj_qkv.weight``
    ``[2·Hk·K + Hv·V, D]`` and ``in_proj_z.weight`` ``[Hv·V, D]``; ``in_proj_ba.weight`` ``[2·Hv, D]`` →
    ``in_proj_b.weight`` and ``in_proj_a.weight`` ``[Hv, D]`` (see ``qwen3_next_layout``)."""
    heads = linear_attention_heads(config)
    d, hv = config.hidden_size, heads.num_value_heads
    qkv_rows = 2 * heads.key_dim + heads.value_dim

    def lookup(name: str) -> FusedTensor | None:
        layer, _, leaf = name.rpartition(".linear_attn.")
        p = f"{layer}.linear_attn"
        if leaf == "in_proj_qkvz.weight":
            return FusedTensor(
                (qkv_rows + heads.value_dim, d),
                (
                    StoredPart(f"{p}.in_proj_qkv.weight", (qkv_rows, d), lambda t: split_in_proj_qkvz(t, heads)[0]),
                    StoredPart(
                        f"{p}.in_proj_z.weight", (heads.value_dim, d), lambda t: split_in_proj_qkvz(t, heads)[1]
                    ),
                ),
            )
        if leaf == "in_proj_ba.weight":
            return FusedTensor(
                (2 * hv, d),
                (
                    StoredPart(f"{p}.in_proj_b.weight", (hv, d), lambda t: split_in_proj_ba(t, heads)[0]),
                    StoredPart(f"{p}.in_proj_a.weight", (hv, d), lambda t: split_in_proj_ba(t, heads)[1]),
                ),
            )
        return None

    return lookup


FAMILY = Family(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    read_config=Qwen3NextConfig.from_hf_dict,
    build_model=Qwen35Model,
    weight_map=build_weight_map,
    canonical_name=canonical_name,
    skipped=SKIPPED,
    fused_tensors=fused_tensors,
)
