"""The Qwen3.5 decoder: embeddings, Gated DeltaNet / gated attention layers with SwiGLU MLPs (dense) or
Qwen's MoE block (MoE), zero-centred norms, LM head."""

from __future__ import annotations

import torch
from torch import nn

from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.families.family import Family
from metrale.worker.model.families.qwen3_5_config import Qwen35Config, Qwen35MoeConfig
from metrale.worker.model.families.qwen3_5_weights import SKIPPED, build_weight_map, canonical_name
from metrale.worker.model.layers.gated_attention import GatedAttention, RotaryAngles
from metrale.worker.model.layers.gated_deltanet import GatedDeltaNet
from metrale.worker.model.layers.linear import Linear
from metrale.worker.model.layers.mlp import DenseMLP
from metrale.worker.model.layers.norms import ZeroCenteredRMSNorm
from metrale.worker.model.layers.qwen_moe import QwenMoE
from metrale.worker.model.layers.rotary import PartialRotary, row_positions
from metrale.worker.model.state import StatePool


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, config: Qwen35Config, layer_idx: int, rotary: PartialRotary) -> None:
        super().__init__()
        self.input_norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn: GatedDeltaNet | GatedAttention = (
            GatedDeltaNet(config, layer_idx)
            if config.layer_types[layer_idx] == "linear_attention"
            else GatedAttention(config, layer_idx, rotary)
        )
        self.post_attn_norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: DenseMLP | QwenMoE = (
            QwenMoE(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                config.shared_expert_intermediate_size,
                norm_topk_prob=config.norm_topk_prob,
            )
            if isinstance(config, Qwen35MoeConfig) and config.is_moe_layer(layer_idx)
            else DenseMLP(config.hidden_size, config.intermediate_size)
        )

    def forward(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool, angles: RotaryAngles) -> torch.Tensor:
        h = self.input_norm(x)
        if isinstance(self.attn, GatedAttention):
            x = x + self.attn(h, layout, pool, angles)
        else:
            x = x + self.attn(h, layout, pool)
        return x + self.mlp(self.post_attn_norm(x))


class Qwen35Model(nn.Module):
    """Qwen3.5 (dense or MoE) for causal LM over a flat batch of rows (see :class:`BatchLayout`).

    The model holds weights only; all per-sequence state is in the :class:`StatePool` passed in.
    """

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.config = config
        # Left uninitialised, as every weight here: the loader fills them.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.rotary = PartialRotary(config.rotary_dim, config.rope_theta)
        self.layers = nn.ModuleList(Qwen35DecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        # Never tied here: the loader fills it from the checkpoint's LM head, or from the embeddings.
        self.lm_head = Linear(config.hidden_size, config.vocab_size)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the weights (a few small parameters stay fp32: ``precision.FP32_PARAMETERS``)."""
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, layout: BatchLayout, pool: StatePool, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run all rows; return logits ``[len(logit_rows), vocab]`` (model dtype) of the rows asked for."""
        x = self.embed_tokens(layout.token_ids)
        angles = self.rotary.angles(row_positions(layout), x.dtype)
        for layer in self.layers:
            x = layer(x, layout, pool, angles)
        return self.lm_head(self.norm(x[logit_rows]))


FAMILY = Family(
    name="qwen3_5",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    model_types=("qwen3_5", "qwen3_5_text"),
    read_config=Qwen35Config.from_hf_dict,
    build_model=Qwen35Model,
    weight_map=build_weight_map,
    canonical_name=canonical_name,
    skipped=SKIPPED,
)

FAMILY_MOE = Family(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    read_config=Qwen35MoeConfig.from_hf_dict,
    build_model=Qwen35Model,
    weight_map=build_weight_map,
    canonical_name=canonical_name,
    skipped=SKIPPED,
)
