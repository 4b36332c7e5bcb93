"""Gated full attention (Qwen3.5, Qwen3-Next): GQA with per-head q/k norms, partial RoPE and a sigmoid
output gate, over the block-paged key/value cache."""

from __future__ import annotations

import torch
from torch import nn

from metrale.worker.kernels import ops
from metrale.worker.kernels.pointwise import row_invariant
from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.families.qwen3_5_config import Qwen35Config
from metrale.worker.model.layers.linear import Linear
from metrale.worker.model.layers.norms import ZeroCenteredRMSNorm
from metrale.worker.model.layers.rotary import PartialRotary
from metrale.worker.model.state import StatePool

RotaryAngles = tuple[torch.Tensor, torch.Tensor]
"""``(cos, sin)`` ``[N, 1, R]`` of every row's position (``PartialRotary.angles``), shared by the layers."""


class GatedAttention(nn.Module):
    """One gated attention layer. ``in_proj`` fuses ``q_proj``, ``k_proj`` and ``v_proj``:
    ``[2·H·D + 2·Hkv·D, D_model]``. HF's ``q_proj`` holds, per head, the query's ``D`` rows and then the
    gate's ``D`` rows (``view(…, H, 2·D).chunk(2)``); the loader keeps that order.

    The output is ``o_proj(attention · sigmoid(gate))``. Keys are cached after their norm and rotation,
    so the cache holds exactly what attention reads.
    """

    def __init__(self, config: Qwen35Config, layer_idx: int, rotary: PartialRotary) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.split_sizes = [2 * self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]
        self.in_proj = Linear(config.hidden_size, sum(self.split_sizes))
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool, angles: RotaryAngles) -> torch.Tensor:
        """``x`` ``[N, D]`` → ``[N, D]``; stores each row's key and value, then attends over each sequence's cache."""
        n = x.shape[0]
        q_and_gate, k, v = self.in_proj(x).split(self.split_sizes, dim=-1)
        q, gate = q_and_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.rotary.apply(self.q_norm(q), *angles)
        k = self.rotary.apply(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), *angles)
        cache = pool.kv[self.layer_idx]
        ops.store_kv(cache, k, v.view(n, self.num_kv_heads, self.head_dim), layout.slot_mapping)
        out = ops.paged_gqa_attention(q, cache, layout.block_tables, layout.cu_seqlens, layout.context_lens, self.scale)
        out = out.reshape(n, -1) * row_invariant(torch.sigmoid, gate.reshape(n, -1))
        return self.o_proj(out)
