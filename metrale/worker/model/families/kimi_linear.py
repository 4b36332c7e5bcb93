"""The KimiLinear decoder: embeddings, KDA / MLA layers with dense or MoE MLPs, final norm, LM head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.families.family import Family
from metrale.worker.model.families.kimi_linear_decode import FusedDecodeLayers
from metrale.worker.model.layers.kda import KimiDeltaAttention
from metrale.worker.model.layers.linear import Linear
from metrale.worker.model.layers.mla import LatentAttention
from metrale.worker.model.layers.mlp import DenseMLP, MoE
from metrale.worker.model.layers.norms import RMSNorm
from metrale.worker.model.state import StatePool
from metrale.worker.model.weight_map import build_weight_map, canonical_name


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn: KimiDeltaAttention | LatentAttention = (
            KimiDeltaAttention(config, layer_idx)
            if config.layer_types[layer_idx] == "kda"
            else LatentAttention(config, layer_idx)
        )
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: DenseMLP | MoE = (
            MoE(config)
            if config.mlp_layer_types[layer_idx] == "moe"
            else DenseMLP(config.hidden_size, config.intermediate_size)
        )

    def forward(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), layout, pool)
        return x + self.mlp(self.post_attn_norm(x))


class KimiLinearModel(nn.Module):
    """KimiLinear for causal LM over a flat batch of rows (see :class:`BatchLayout`).

    The model holds weights only; all per-sequence state is in the :class:`StatePool` passed in.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Left uninitialised, like every weight here (the loader fills them): a random normal init would
        # also make building on the meta device import torch's Python decompositions (~150 MB, seconds).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Never tied here: the loader fills it from the checkpoint's LM head, or from the embeddings when
        # the checkpoint ties them and stores no head.
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self._fused: FusedDecodeLayers | None = None

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the weights (a few small parameters stay fp32: ``precision.FP32_PARAMETERS``)."""
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, layout: BatchLayout, pool: StatePool, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run all rows; return logits ``[len(logit_rows), vocab]`` (model dtype) of the rows asked for."""
        x = self.embed_tokens(layout.token_ids)
        fused = self._fused_layers()
        if fused.takes(x, layout, pool):  # decode rows only: the layers as one C call, the same bits
            x = fused.run(x, layout, pool)
        else:
            for layer in self.layers:
                x = layer(x, layout, pool)
        return self.lm_head(self.norm(x[logit_rows]))

    def _fused_layers(self) -> FusedDecodeLayers:
        """The layers described for the C decode step, made on first use (after the weights are loaded)."""
        if self._fused is None:
            self._fused = FusedDecodeLayers(list(self.layers))  # type: ignore[arg-type]
        return self._fused


def _read_config(data: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_hf_dict(data)


FAMILY = Family(
    name="kimi_linear",
    architectures=("KimiLinearForCausalLM",),
    model_types=("kimi_linear",),
    read_config=_read_config,
    build_model=KimiLinearModel,
    weight_map=build_weight_map,
    canonical_name=canonical_name,
)
