"""Benchmark models: the built-in tiny model and larger ones of the same family, all made locally."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metrale.worker.model.tiny import write_tiny_model

MEDIUM: dict[str, Any] = {
    # 8 layers, hidden 512, MoE 8×top-2 (+1 shared): ~19M parameters active per token.
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8],
        "num_heads": 4,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}

LARGE: dict[str, Any] = {
    # 8 layers, hidden 1024, MoE 32×top-4 (+1 shared): ~0.41B parameters, ~0.81 GB in bf16 — large enough
    # that the weights dominate the interpreter's own memory (bench/load_memory.py).
    **MEDIUM,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_experts": 32,
    "num_experts_per_token": 4,
    "num_expert_group": 4,
    "topk_group": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 256,
    "linear_attn_config": {**MEDIUM["linear_attn_config"], "num_heads": 8},
}
MEDIUM_4_HEADS: dict[str, Any] = {
    # ``medium`` with its 2 MLA layers at 4 heads of twice the width (as many heads as its KDA layers have:
    # llama.cpp's Kimi-Linear sizes both from one head count, so it cannot load ``medium`` itself). The
    # KDA layers, MoE and vocabulary are unchanged; MLA's kv_b and o projections keep their shapes, q
    # shrinks from 768 to 640 rows.
    **MEDIUM,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}
_ARCHITECTURES = {"tiny": {}, "medium": MEDIUM, "medium-4-heads": MEDIUM_4_HEADS, "large": LARGE}


def bench_model(name: str, root: Path, dtype: str = "float32") -> Path:
    """Write (once) and return the folder of benchmark model ``name`` (``tiny``, ``medium``,
    ``medium-4-heads``, ``large``)
    stored in ``dtype``."""
    directory = root / (name if dtype == "float32" else f"{name}-{dtype}")
    if not (directory / "model.safetensors").exists():
        write_tiny_model(directory, dtype=dtype, **_ARCHITECTURES[name])
    return directory
