"""Kimi Delta Attention: a gated delta-rule recurrence with per-channel decay, over pooled state."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from metrale.worker.kernels.ops import (
    gated_rms_norm,
    kda_decode,
    kda_prefill,
)
from metrale.worker.kernels.pointwise import row_invariant
from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.layers.linear import Linear
from metrale.worker.model.layers.rows import delta_recurrence, short_conv
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
        qkv = short_conv(qkv.to(conv_states.dtype), self.conv_weight, layout, conv_states)
        q, k_, v = (t.reshape(n, h, k) for t in qkv.chunk(3, dim=-1))
        decay = self._log_decay(f_down)
        # The gates' bits must not depend on the rows around them (a verify row is a decode row's twin):
        # torch's vectorised sigmoid/softplus give a lone row's scalar tail other bits (pointwise).
        beta = row_invariant(torch.sigmoid, b.float())
        core = self._recurrence(q, k_, v, decay, beta, layout, pool.recurrent[self.layer_idx])
        gate = self.g_b_proj(g_down).view(n, h, k)
        out = gated_rms_norm(core, gate, self.o_norm_weight, self.eps).reshape(n, h * k)
        return self.o_proj(out.to(x.dtype))

    def _log_decay(self, f_down: torch.Tensor) -> torch.Tensor:
        """Per-channel log forget gate ``[N, H, K]`` fp32: ``-exp(A_log) · softplus(f + dt_bias)``."""
        f = self.f_b_proj(f_down).float() + self.dt_bias.float()
        f = f.view(f.shape[0], self.num_heads, self.head_dim)
        return -self.A_log.float().exp()[:, None] * row_invariant(partial(F.softplus, threshold=20.0), f)

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
        return delta_recurrence(kda_decode, kda_prefill, q, k, v, decay, beta, layout, states, self.head_dim**-0.5)
