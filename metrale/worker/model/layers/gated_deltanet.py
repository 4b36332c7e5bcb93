"""Gated DeltaNet (Qwen3.5, Qwen3-Next): a delta-rule recurrence with one scalar decay per head, over pooled state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.worker.kernels.ops import gdn_decode, gdn_prefill
from metrale.worker.kernels.pointwise import row_invariant
from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.families.qwen3_5_config import Qwen35Config
from metrale.worker.model.layers.linear import Linear
from metrale.worker.model.layers.norms import silu_gated_rms_norm
from metrale.worker.model.layers.rows import delta_recurrence, short_conv
from metrale.worker.model.state import StatePool

L2_NORM_EPS = 1e-6
"""transformers' ``l2norm`` (and fla's) eps on q and k."""


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x · rsqrt(sum(x²) + 1e-6)`` over the last dimension, in fp32 (transformers' ``l2norm``)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_NORM_EPS)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer. ``in_proj`` fuses HF's four input projections, so a step is one matmul:
    ``[2·Lk + Lv + Lv + Hv + Hv, D]`` = ``in_proj_qkv`` (q, k, v), ``in_proj_z`` (the output gate),
    ``in_proj_b`` (beta), ``in_proj_a`` (the decay's input), with ``Lk = Hk·K`` and ``Lv = Hv·V``;
    ``conv_weight`` ``[2·Lk + Lv, W]`` is the short conv over q, k and v.

    Per token: ``beta = sigmoid(b)``, log-decay ``g = -exp(A_log) · softplus(a + dt_bias)`` per value
    head; q and k L2-normalised, value head ``j`` reading key head ``j // (Hv / Hk)``; the output
    normed, scaled by ``norm_weight`` and gated by ``silu(z)`` per value head.

    Dtypes: the projections run in the weight dtype; from the short conv (fp32 taps over the fp32 conv
    state) to the gated norm everything is fp32, as is the recurrent state; the result is cast back to
    the weight dtype for ``out_proj``.
    """

    def __init__(self, config: Qwen35Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.eps = config.rms_norm_eps
        conv_dim, lv = config.conv_dim, config.linear_value_dim
        self.split_sizes = [conv_dim, lv, self.value_heads, self.value_heads]
        self.qkv_sizes = [config.linear_key_dim, config.linear_key_dim, lv]
        self.in_proj = Linear(config.hidden_size, sum(self.split_sizes))
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, config.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads))
        self.A_log = nn.Parameter(torch.empty(self.value_heads))
        self.norm_weight = nn.Parameter(torch.ones(self.value_dim))
        self.out_proj = Linear(lv, config.hidden_size)

    def forward(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """``x`` ``[N, D]`` → ``[N, D]``; advances this layer's state of every sequence in ``layout``."""
        n = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(self.split_sizes, dim=-1)
        conv_states = pool.conv[self.layer_idx]
        qkv = short_conv(qkv.to(conv_states.dtype), self.conv_weight, layout, conv_states)
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = l2_normalize(q.reshape(n, self.key_heads, self.key_dim))
        k = l2_normalize(k.reshape(n, self.key_heads, self.key_dim))
        v = v.reshape(n, self.value_heads, self.value_dim)
        # Per-head gates of a few values a row: row_invariant keeps them in torch's vector code (issue #30).
        log_decay = -self.A_log.float().exp() * row_invariant(F.softplus, a.float() + self.dt_bias.float())
        beta = row_invariant(torch.sigmoid, b.float())
        core = self._recurrence(q, k, v, log_decay, beta, layout, pool.recurrent[self.layer_idx])
        gate = z.reshape(n, self.value_heads, self.value_dim)
        out = silu_gated_rms_norm(core, gate, self.norm_weight, self.eps).reshape(n, -1)
        return self.out_proj(out.to(x.dtype))

    def _recurrence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_decay: torch.Tensor,
        beta: torch.Tensor,
        layout: BatchLayout,
        states: torch.Tensor,
    ) -> torch.Tensor:
        return delta_recurrence(gdn_decode, gdn_prefill, q, k, v, log_decay, beta, layout, states, self.key_dim**-0.5)
