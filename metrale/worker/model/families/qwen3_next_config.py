"""Qwen3-Next model configuration, read from a flat Hugging Face ``config.json`` (``Qwen3NextForCausalLM``,
``model_type`` ``qwen3_next``).

The same layers as Qwen3.5 MoE (Gated DeltaNet and gated attention, Qwen's MoE block), described flat:
no ``text_config``, ``rope_theta`` and ``partial_rotary_factor`` at the top level (or in ``rope_parameters``,
as transformers writes them), no ``layer_types`` in the release (every 4th layer is full attention), and
the MoE block on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` leave it (a dense MLP of
``intermediate_size`` elsewhere), its router renormalizing the top k only when ``norm_topk_prob``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from metrale.worker.model.config import ModelConfigError
from metrale.worker.model.families.qwen3_5_config import Qwen35Config, Qwen35MoeConfig, QwenConfigFields
from metrale.worker.model.families.qwen_sizing import moe_layer_flags


@dataclass(frozen=True)
class Qwen3NextConfig(Qwen35MoeConfig):
    """A Qwen3-Next model: ``moe_layers[i]`` says whether layer ``i`` runs the MoE block."""

    family: ClassVar[str] = "qwen3_next"

    moe_layers: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        Qwen35Config.__post_init__(self)
        if len(self.moe_layers) != self.num_hidden_layers:
            raise ModelConfigError(
                f"moe_layers has {len(self.moe_layers)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        if any(self.moe_layers):
            self.check_experts()

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layers[layer]

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen3NextConfig:
        """Build from a Qwen3-Next ``config.json``; raise ``ModelConfigError`` naming any bad field."""
        fields = QwenConfigFields(data)
        fields.check_supported()
        common = fields.common_fields()
        num_layers = common["num_hidden_layers"]
        num_experts = int(fields.get("num_experts", 0))
        sparse_step = int(fields.get("decoder_sparse_step", 1))
        if sparse_step < 1:
            raise ModelConfigError(f"config.json: decoder_sparse_step={sparse_step} must be at least 1")
        dense_only = fields.get("mlp_only_layers", [])
        if not isinstance(dense_only, list) or any(
            not isinstance(i, int) or not 0 <= i < num_layers for i in dense_only
        ):
            raise ModelConfigError(
                f"config.json: mlp_only_layers={dense_only!r} must list layer indices in 0..{num_layers - 1}"
            )
        moe_layers = moe_layer_flags(num_layers, num_experts, sparse_step, set(dense_only))
        experts: dict[str, Any] = {}
        if any(moe_layers):
            experts = {
                "num_experts": num_experts,
                "num_experts_per_tok": int(fields.require("num_experts_per_tok")),
                "moe_intermediate_size": int(fields.require("moe_intermediate_size")),
                "shared_expert_intermediate_size": int(fields.require("shared_expert_intermediate_size")),
                "norm_topk_prob": bool(fields.get("norm_topk_prob", True)),
            }
        dense = not all(moe_layers)
        intermediate_size = int(fields.require("intermediate_size") if dense else fields.get("intermediate_size", 0))
        return cls(**common, **experts, intermediate_size=intermediate_size, moe_layers=moe_layers)
