"""Kimi Delta Attention: a gated delta-rule recurrence with per-channel decay, over pooled state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.worker.kernels.ops import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    gated_rms_norm,
    kda_decode,
    kda_prefill,
)
from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.linear import Linear
from metrale.worker.model.state import StatePool


class KimiDeltaAttention(nn.Module):
    """One KDA layer. Parameters are fused where HF keeps them apart, so a step is few matmuls:

    ``in_proj`` ``[3·L + K + K + H, D]`` = q, k, v, forget-gate down, output-gate down, beta projections
    (L = H·K); ``conv_weight`` ``[3·L, W]`` = the q, k, v short convs.

    Dtypes: the projections run in the weight dtype; from the short conv (fp32 taps over the fp32 conv
    state) to the gated output norm everything is fp32 — q, k, v, decay, beta and the recurrence over
    its fp32 state — and the result is cast back to the weight dtype for ``o_proj``.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.linear_num_heads, config.linear_head_dim
        self.eps = config.rms_norm_eps
        width, h, k = config.linear_dim, self.num_heads, self.head_dim
        self.split_sizes = [3 * width, k, k, h]
        self.in_proj = Linear(config.hidden_size, sum(self.split_sizes))
        self.conv_weight = nn.Parameter(torch.empty(3 * width, config.linear_conv_kernel_dim))
        self.f_b_proj = Linear(k, width)
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.A_log = nn.Parameter(torch.empty(h))
        self.g_b_proj = Linear(k, width)
        self.o_norm_weight = nn.Parameter(torch.ones(k))
        self.o_proj = Linear(width, config.hidden_size)

    def forward(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """``x`` ``[N, D]`` → ``[N, D]``; advances this layer's state of every sequence in ``layout``."""
        n, h, k = x.shape[0], self.num_heads, self.head_dim
        qkv, f_down, g_down, b = self.in_proj(x).split(self.split_sizes, dim=-1)
        conv_states = pool.conv[self.layer_idx]
        qkv = self._short_conv(qkv.to(conv_states.dtype), layout, conv_states)
        q, k_, v = (t.reshape(n, h, k) for t in qkv.chunk(3, dim=-1))
        decay = self._log_decay(f_down)
        beta = torch.sigmoid(b.float())
        core = self._recurrence(q, k_, v, decay, beta, layout, pool.recurrent[self.layer_idx])
        gate = self.g_b_proj(g_down).view(n, h, k)
        out = gated_rms_norm(core, gate, self.o_norm_weight, self.eps).reshape(n, h * k)
        return self.o_proj(out.to(x.dtype))

    def _log_decay(self, f_down: torch.Tensor) -> torch.Tensor:
        """Per-channel log forget gate ``[N, H, K]`` fp32: ``-exp(A_log) · softplus(f + dt_bias)``."""
        f = self.f_b_proj(f_down).float() + self.dt_bias.float()
        f = f.view(f.shape[0], self.num_heads, self.head_dim)
        return -self.A_log.float().exp()[:, None] * F.softplus(f, threshold=20.0)

    def _short_conv(self, qkv: torch.Tensor, layout: BatchLayout, states: torch.Tensor) -> torch.Tensor:
        d = layout.num_decode
        if d == layout.num_rows:  # decode rows only: no slicing, no concatenation
            return causal_conv1d_update(qkv, self.conv_weight, states, layout.slots)
        parts = []
        if d:
            parts.append(causal_conv1d_update(qkv[:d], self.conv_weight, states, layout.slots[:d]))
        if d < layout.num_rows:
            parts.append(
                causal_conv1d_prefill(
                    qkv[d:],
                    self.conv_weight,
                    layout.prefill_cu_seqlens,
                    states,
                    layout.slots[d:],
                    layout.has_initial_state[d:],
                )
            )
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _recurrence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
        layout: BatchLayout,
        states: torch.Tensor,
    ) -> torch.Tensor:
        d, scale = layout.num_decode, self.head_dim**-0.5
        if d == layout.num_rows:
            return kda_decode(q, k, v, decay, beta, states, layout.slots, scale)
        parts = []
        if d:
            parts.append(kda_decode(q[:d], k[:d], v[:d], decay[:d], beta[:d], states, layout.slots[:d], scale))
        if d < layout.num_rows:
            parts.append(
                kda_prefill(
                    q[d:],
                    k[d:],
                    v[d:],
                    decay[d:],
                    beta[d:],
                    layout.prefill_cu_seqlens,
                    states,
                    layout.slots[d:],
                    layout.has_initial_state[d:],
                    scale,
                )
            )
        return torch.cat(parts) if len(parts) > 1 else parts[0]
