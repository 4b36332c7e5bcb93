"""Benchmark models: the built-in tiny model and a larger one of the same family, both made locally."""

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


def bench_model(name: str, root: Path) -> Path:
    """Write (once) and return the folder of benchmark model ``name``: ``tiny`` or ``medium``."""
    directory = root / name
    if not (directory / "model.safetensors").exists():
        write_tiny_model(directory, **(MEDIUM if name == "medium" else {}))
    return directory
