"""Tiny random Qwen3.5 (dense, MoE) and Qwen3-Next checkpoints made by transformers itself, in the release
layout (``Qwen3_5(Moe)ForConditionalGeneration``: the language model under ``model.language_model.``, a
small vision tower under ``model.visual.``; ``Qwen3NextForCausalLM``: flat under ``model.``, fused
``in_proj_qkvz`` / ``in_proj_ba``; bf16 tensors): the outside yardstick for our Qwen families."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LINEAR, FULL = "linear_attention", "full_attention"

QWEN_CONFIGS: dict[str, dict[str, Any]] = {
    # The 0.8B's shape at a small size: 16 key and 16 value heads, tied embeddings, 3 linear : 1 full.
    "gdn16k16v-gqa4q1kv-tied": {
        "num_hidden_layers": 4,
        "layer_types": [LINEAR, LINEAR, LINEAR, FULL],
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    },
    # The 4B's: value heads twice the key heads, untied, two full-attention layers (one first).
    "gdn16k32v-gqa4q2kv-untied": {
        "num_hidden_layers": 5,
        "layer_types": [FULL, LINEAR, LINEAR, LINEAR, FULL],
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
}

QWEN_MOE_CONFIGS: dict[str, dict[str, Any]] = {
    # The 35B-A3B's shape at a small size: 8 experts, top 2, a shared expert, value heads twice the key heads.
    "moe8top2-gdn16k32v-untied": {
        "num_hidden_layers": 4,
        "layer_types": [LINEAR, LINEAR, LINEAR, FULL],
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "moe4top1-gdn16k16v-tied": {
        "num_hidden_layers": 4,
        "layer_types": [FULL, LINEAR, LINEAR, FULL],
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
}

QWEN_NEXT_CONFIGS: dict[str, dict[str, Any]] = {
    # The 80B-A3B's shape at a small size: no layer_types (every 4th layer full attention), value heads twice
    # the key heads, MoE in every layer with renormalized top k, untied.
    "next-moe8top2-gdn16k32v-untied": {
        "num_hidden_layers": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # Dense and MoE layers mixed: MoE where (i + 1) % 2 == 0 except layer 3 (dense: mlp_only_layers), so
    # layers 1 and 5 route; top k not renormalized; Hv = Hk; tied.
    "next-sparse2-dense3-gdn16k16v-tied": {
        "num_hidden_layers": 6,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    },
}

_NEXT_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
"""Qwen3-Next's plain 1-D RoPE over 4 of 16 dims (64 of 256 in the release)."""

_TEXT_BASE: dict[str, Any] = {
    "vocab_size": 211,
    "hidden_size": 64,
    "intermediate_size": 96,
    "head_dim": 16,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,  # 4 of 16 dims, as 64 of 256 in the releases
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "initializer_range": 0.1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 4,
    "spatial_merge_size": 1,
    "temporal_patch_size": 1,
}


def hf_model_class(name: str) -> Any:
    """transformers' ``Qwen3_5ForConditionalGeneration`` for a dense config, the MoE one for a MoE config,
    ``Qwen3NextForCausalLM`` for a Qwen3-Next one."""
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM

    if name in QWEN_NEXT_CONFIGS:
        return Qwen3NextForCausalLM
    return Qwen3_5MoeForConditionalGeneration if name in QWEN_MOE_CONFIGS else Qwen3_5ForConditionalGeneration


def make_hf_qwen_checkpoint(name: str, directory: Path, *, seed: int = 0) -> Any:
    """Create a random transformers ``Qwen3_5(Moe)ForConditionalGeneration`` (or ``Qwen3NextForCausalLM``,
    flat, without a vision tower), save it in bf16
    (``save_pretrained``) and return it, cast to bf16 and back so that it holds the saved values in fp32.

    The zero-centred norm weights are drawn around zero (transformers initialises them to zero, which
    would leave the ``1 + w`` form untested); likewise the gated norm's weights around one.
    """
    model_class = hf_model_class(name)
    torch.manual_seed(seed)
    if name in QWEN_NEXT_CONFIGS:
        config = model_class.config_class(**{**_TEXT_BASE, "rope_parameters": _NEXT_ROPE, **QWEN_NEXT_CONFIGS[name]})
    else:
        text = {**_TEXT_BASE, **QWEN_CONFIGS.get(name, QWEN_MOE_CONFIGS.get(name, {}))}
        config = model_class.config_class(
            text_config=text, vision_config=_VISION, tie_word_embeddings=text["tie_word_embeddings"]
        )
    model = model_class(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")):
                param.normal_(0.0, 0.2)
            elif param_name.endswith("linear_attn.norm.weight"):
                param.normal_(1.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(directory)
    return model.to(torch.float32)
