"""A Kimi-Linear model's decoder layers over a forward of decode rows as one C call
(``kernels.native.decode_layers``), where it runs: fp32 weights and pools, the C kernels' backend, no
``q_lora`` projection. The layers are described once per set of pools (weights and pools do not move
between steps); :meth:`FusedDecodeLayers.run` is the twin of the layers' op-by-op loop, bit for bit."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from metrale.worker.kernels.native import decode_layers as native
from metrale.worker.kernels.ops import uses_native
from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.layers.kda import KimiDeltaAttention
from metrale.worker.model.layers.mla import LatentAttention
from metrale.worker.model.layers.mlp import DenseMLP, MoE
from metrale.worker.model.state import StatePool

if TYPE_CHECKING:
    from metrale.worker.model.families.kimi_linear import DecoderLayer


class FusedDecodeLayers:
    """``layers`` (a ``KimiLinearModel``'s) described for the C decode step."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.layers = layers
        self.fits = all(
            p.dtype == torch.float32 and p.device.type == "cpu" for layer in layers for p in layer.parameters()
        )
        self.fits &= all(
            not isinstance(layer.attn, LatentAttention) or layer.attn.q_lora_rank is None for layer in layers
        )
        self._described: tuple[tuple[int, ...], ctypes.Array[native.DecodeLayer], list[torch.Tensor], int] | None = None

    def takes(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> bool:
        """Whether :meth:`run` runs this forward: decode rows only, fp32 throughout, the C kernels' backend."""
        return (
            self.fits
            and layout.verify is None
            and layout.num_decode == x.shape[0] > 0
            and x.dtype == torch.float32
            and not torch.compiler.is_compiling()
            and uses_native()
            and native.available()
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in _pool_tensors(pool))
        )

    def run(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """``x [B, D]`` (the embeddings of B decode rows) through every layer -> ``[B, D]``; ``pool`` advanced."""
        described, scratch = self._describe(pool)
        return native.decode_layers(
            x,
            described,
            slots=layout.slots,
            slot_mapping=layout.slot_mapping,
            block_tables=layout.block_tables,
            context_lens=layout.context_lens,
            scratch_floats=scratch * x.shape[0],
        )

    def _describe(self, pool: StatePool) -> tuple[ctypes.Array[native.DecodeLayer], int]:
        """The layers' description for ``pool`` (made again when a pool tensor moved) and its scratch floats per
        row; the tensors made for it stay held in ``_described`` beside it."""
        key = tuple(t.data_ptr() for t in _pool_tensors(pool)) + tuple(
            layer.input_norm.weight.data_ptr() for layer in self.layers
        )
        if self._described is None or self._described[0] != key:
            held: list[torch.Tensor] = []
            described = (native.DecodeLayer * len(self.layers))(
                *(_describe_layer(layer, pool, held) for layer in self.layers)
            )
            scratch = max(_scratch_per_row(layer) for layer in self.layers)
            self._described = (key, described, held, scratch)
        _, described, _held, scratch = self._described
        return described, scratch


def _pool_tensors(pool: StatePool) -> list[torch.Tensor]:
    return [*pool.conv.values(), *pool.recurrent.values(), *pool.kv.values()]


def _describe_layer(layer: DecoderLayer, pool: StatePool, held: list[torch.Tensor]) -> native.DecodeLayer:
    """``layer`` as the C step reads it; tensors made for it (``-exp(A_log)``) are kept in ``held``."""
    attn, mlp = layer.attn, layer.mlp
    d = native.DecodeLayer(
        input_norm=layer.input_norm.weight.data_ptr(), post_norm=layer.post_attn_norm.weight.data_ptr()
    )
    d.norm_eps = layer.input_norm.eps
    if isinstance(attn, KimiDeltaAttention):
        neg_a = -attn.A_log.float().exp()
        held.append(neg_a)
        d.attention = 0
        d.kda_in_proj, d.kda_conv_weight = attn.in_proj.weight.data_ptr(), attn.conv_weight.data_ptr()
        d.kda_f_b, d.kda_dt_bias, d.kda_neg_a = (
            attn.f_b_proj.weight.data_ptr(),
            attn.dt_bias.data_ptr(),
            neg_a.data_ptr(),
        )
        d.kda_g_b, d.kda_o_norm = attn.g_b_proj.weight.data_ptr(), attn.o_norm_weight.data_ptr()
        d.kda_o_proj = attn.o_proj.weight.data_ptr()
        d.conv_pool, d.state_pool = pool.conv[attn.layer_idx].data_ptr(), pool.recurrent[attn.layer_idx].data_ptr()
        d.kda_heads, d.kda_head_dim, d.conv_width = attn.num_heads, attn.head_dim, attn.conv_weight.shape[1]
        d.kda_scale = attn.head_dim**-0.5
    else:
        cache = pool.kv[attn.layer_idx]
        d.attention = 1
        d.mla_in_proj, d.mla_kv_norm = attn.in_proj.weight.data_ptr(), attn.kv_a_norm_weight.data_ptr()
        d.mla_kv_b, d.mla_o_proj, d.kv_cache = (
            attn.kv_b_proj.weight.data_ptr(),
            attn.o_proj.weight.data_ptr(),
            cache.data_ptr(),
        )
        d.mla_heads, d.nope_dim, d.rope_dim = attn.num_heads, attn.nope_dim, attn.rope_dim
        d.v_dim, d.kv_rank, d.block_size = attn.v_dim, attn.kv_rank, cache.shape[1]
        d.mla_scale = attn.scale
    dense = mlp if isinstance(mlp, DenseMLP) else mlp.shared
    if dense is not None:
        d.gate_up, d.down, d.intermediate = (
            dense.gate_up.weight.data_ptr(),
            dense.down.weight.data_ptr(),
            dense.down.weight.shape[1],
        )
    if isinstance(mlp, MoE):
        d.moe = 1
        d.router, d.router_bias = mlp.router_weight.data_ptr(), mlp.router_bias.data_ptr()
        d.experts_gate_up, d.experts_down = mlp.experts_gate_up.data_ptr(), mlp.experts_down.data_ptr()
        d.experts, d.groups, d.topk_group = mlp.experts_gate_up.shape[0], mlp.num_groups, mlp.topk_group
        d.top_k, d.renormalize, d.scaling = mlp.top_k, int(mlp.renormalize), mlp.scaling
        d.expert_intermediate = mlp.experts_down.shape[2]
    return d


def _scratch_per_row(layer: DecoderLayer) -> int:
    """Scratch floats per decode row the C step needs for ``layer`` (``decode_layers.c``'s layout)."""
    attn, mlp, hidden = layer.attn, layer.mlp, layer.input_norm.weight.shape[0]
    need = 0
    if isinstance(attn, LatentAttention):
        heads, width = attn.num_heads, attn.kv_rank + attn.rope_dim
        projection = attn.in_proj.weight.shape[0]
        need = projection + heads * attn.kv_rank * 2 + heads * width + 2 * heads * attn.v_dim
    if isinstance(mlp, MoE):
        need = max(need, 3 * mlp.top_k + hidden)
    return need
