"""Tiny random KimiLinear checkpoints made by transformers itself: the outside yardstick for our model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

HF_CONFIGS: dict[str, dict[str, Any]] = {
    "dense-qfull-kda-mla-kda": {
        "num_hidden_layers": 3,
        "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2]},
        "q_lora_rank": None,
        "first_k_dense_replace": 3,
    },
    "moe-qlora-mla-kda-kda-mla": {
        "num_hidden_layers": 4,
        "linear_attn_config": {"kda_layers": [2, 3], "full_attn_layers": [1, 4]},
        "q_lora_rank": 16,
        "first_k_dense_replace": 1,
    },
    "moe-norenorm-tied-shared2": {
        "num_hidden_layers": 5,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]},
        "q_lora_rank": None,
        "first_k_dense_replace": 0,
        "norm_topk_prob": False,
        "tie_word_embeddings": True,
        "n_shared_experts": 2,
        "n_group": 4,
        "topk_group": 2,
    },
}

_BASE: dict[str, Any] = {
    "vocab_size": 211,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "initializer_range": 0.15,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_hf_checkpoint(
    name: str, directory: Path, *, dtype: torch.dtype = torch.float32, seed: int = 0, fixed_routing: bool = False
) -> Any:
    """Create, save (``save_pretrained``) and return a random transformers KimiLinearForCausalLM.

    ``fixed_routing`` sets each router's score-correction bias to ``3·2^p`` (``p`` a permutation of the
    experts): every sum of two biases differs from every other by at least 3, more than the scores
    (sigmoids, < 1 each) can move it, so every token picks the same groups and experts whatever the
    rounding. The scores still weight the experts. Comparing two bf16 computations on random routers
    otherwise compares where near-ties flip, not numerics.
    """
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    fields = {**_BASE, **HF_CONFIGS[name]}
    linear = {"head_dim": 16, "num_heads": 3, "short_conv_kernel_size": 4, **fields.pop("linear_attn_config")}
    torch.manual_seed(seed)
    config = KimiLinearConfig(linear_attn_config=linear, **fields)
    model = KimiLinearForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None and fixed_routing:
                bias.copy_(3.0 * 2.0 ** torch.randperm(bias.numel(), generator=generator).float())
            elif bias is not None:
                bias.normal_(0.0, 0.1)
    model = model.to(dtype)
    model.save_pretrained(directory)
    return model
