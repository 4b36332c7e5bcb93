"""Multi-head Latent Attention (NoPE, as in Kimi Linear) over the block-paged latent cache."""

from __future__ import annotations

import torch
from torch import nn

from metrale.worker.kernels.ops import paged_mla_attention, rms_norm, store_latents
from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.layers.linear import Linear
from metrale.worker.model.state import StatePool


class LatentAttention(nn.Module):
    """One MLA layer. ``in_proj`` fuses the query projection (``q_proj``, or ``q_a_proj`` when
    ``q_lora_rank`` is set) with ``kv_a_proj_with_mqa``: ``[Q + C + R, D]``.

    Only the latent (``C + R`` values per token) is cached; keys and values are never expanded — the
    attention kernel absorbs ``kv_b_proj`` into the query and the output.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        self.eps = config.rms_norm_eps
        self.scale = config.qk_head_dim**-0.5
        q_width = self.num_heads * config.qk_head_dim
        self.q_lora_rank = config.q_lora_rank
        q_in = q_width if config.q_lora_rank is None else config.q_lora_rank
        self.split_sizes = [q_in, config.latent_dim]
        self.in_proj = Linear(config.hidden_size, q_in + config.latent_dim)
        if config.q_lora_rank is not None:
            self.q_a_norm_weight = nn.Parameter(torch.ones(config.q_lora_rank))
            self.q_b_proj = Linear(config.q_lora_rank, q_width)
        self.kv_a_norm_weight = nn.Parameter(torch.ones(config.kv_lora_rank))
        self.kv_b_proj = Linear(config.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim))
        self.o_proj = Linear(self.num_heads * self.v_dim, config.hidden_size)

    def forward(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """``x`` ``[N, D]`` → ``[N, D]``; stores each row's latent, then attends over each sequence's cache."""
        n = x.shape[0]
        q, latent = self.in_proj(x).split(self.split_sizes, dim=-1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(rms_norm(q, self.q_a_norm_weight, self.eps))
        q_nope, q_rope = q.view(n, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_latent, k_rope = latent.split([self.kv_rank, self.rope_dim], dim=-1)
        cache = pool.kv[self.layer_idx]
        store_latents(
            cache,
            torch.cat([rms_norm(kv_latent, self.kv_a_norm_weight, self.eps), k_rope], -1),
            layout.slot_mapping,
        )
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)
        out = paged_mla_attention(
            q_nope,
            q_rope,
            cache,
            layout.block_tables,
            layout.cu_seqlens,
            layout.context_lens,
            w_uk,
            w_uv,
            self.scale,
        )
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))
