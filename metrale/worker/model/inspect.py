"""A checkpoint's vital numbers: layer pattern, parameters (total and active per token), state bytes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.worker.model.config import ModelConfig
from metrale.worker.model.loader import stored_shapes
from metrale.worker.model.state import StateSizes, state_sizes


@dataclass(frozen=True)
class ModelSummary:
    directory: Path
    config: ModelConfig
    total_params: int
    active_params: int
    state: StateSizes
    dtype: torch.dtype

    def rows(self) -> list[tuple[str, str]]:
        c = self.config
        pattern = " ".join(f"{t}/{m}" for t, m in zip(c.layer_types, c.mlp_layer_types, strict=True))
        moe = (
            f"{c.num_experts} experts, top-{c.num_experts_per_token}, {c.num_shared_experts} shared"
            if "moe" in c.mlp_layer_types
            else "none"
        )
        return [
            ("layers", f"{c.num_hidden_layers}: {pattern}"),
            ("hidden size", str(c.hidden_size)),
            ("KDA", f"{c.linear_num_heads} heads × {c.linear_head_dim}, conv {c.linear_conv_kernel_dim}"),
            (
                "MLA",
                f"{c.num_attention_heads} heads, kv_lora_rank {c.kv_lora_rank}, q_lora_rank {c.q_lora_rank}",
            ),
            ("MoE", moe),
            ("vocab", str(c.vocab_size)),
            ("context", str(c.max_position_embeddings)),
            ("parameters", f"{self.total_params:,} ({self.active_params:,} active per token)"),
            ("state per sequence", f"{self.state.slot_bytes:,} bytes (KDA, constant; {self.dtype} conv)"),
            ("state per token", f"{self.state.token_bytes:,} bytes (MLA latents)"),
        ]


def summarize(directory: Path, config: ModelConfig, dtype: torch.dtype) -> ModelSummary:
    shapes = stored_shapes(directory)
    total = sum(_numel(s) for s in shapes.values())
    expert_params = sum(_numel(s) for name, s in shapes.items() if ".experts." in name)
    moe_layers = config.mlp_layer_types.count("moe")
    active_experts = expert_params * config.num_experts_per_token // max(config.num_experts, 1)
    active = total - expert_params + (active_experts if moe_layers else 0)
    return ModelSummary(directory, config, total, active, state_sizes(config, dtype), dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
