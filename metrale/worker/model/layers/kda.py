"""Kimi Delta Attention: a gated delta-rule recurrence with per-channel decay, over pooled state."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from metrale.worker.kernels.native import kda_layer as native_kda_layer
from metrale.worker.kernels.ops import (
    gated_rms_norm,
    kda_decode,
    kda_prefill,
    uses_native,
)
from metrale.worker.kernels.pointwise import row_invariant
from metrale.worker.kernels.products import decode_rows, one_order_rows, row_sigmoid, rows_of_kind
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

    A forward of decode rows only (no verify rows) of an fp32 model runs the layer as one C call
    (``native.kda_layer``) where the C kernels run; :meth:`plain` is the op-by-op twin, which every other
    forward takes and which gives a decode row the same bits (its gates through the same C functions).
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
        conv_states, states = pool.conv[self.layer_idx], pool.recurrent[self.layer_idx]
        if self._fused_decode(x, layout, conv_states, states):
            return native_kda_layer.decode_layer(
                x,
                in_proj=self.in_proj.weight,
                conv_weight=self.conv_weight,
                conv_states=conv_states,
                f_b=self.f_b_proj.weight,
                dt_bias=self.dt_bias,
                neg_a=-self.A_log.float().exp(),
                g_b=self.g_b_proj.weight,
                o_norm=self.o_norm_weight,
                eps=self.eps,
                o_proj=self.o_proj.weight,
                states=states,
                slots=layout.slots,
                scale=self.head_dim**-0.5,
            )
        return self.plain(x, layout, pool)

    def _fused_decode(
        self, x: torch.Tensor, layout: BatchLayout, conv_states: torch.Tensor, states: torch.Tensor
    ) -> bool:
        weights = [self.in_proj.weight, self.conv_weight, self.f_b_proj.weight, self.dt_bias, self.A_log]
        weights += [self.g_b_proj.weight, self.o_norm_weight, self.o_proj.weight]
        return (
            layout.verify is None
            and layout.num_decode == x.shape[0] > 0
            and uses_native()
            and one_order_rows(x, self.in_proj.weight) == x.shape[0]
            and native_kda_layer.supports(x, weights, conv_states, states)
        )

    def plain(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """:meth:`forward` op by op."""
        n, h, k = x.shape[0], self.num_heads, self.head_dim
        qkv, f_down, g_down, b = self.in_proj(x).split(self.split_sizes, dim=-1)
        conv_states = pool.conv[self.layer_idx]
        qkv = short_conv(qkv.to(conv_states.dtype), self.conv_weight, layout, conv_states)
        q, k_, v = (t.reshape(n, h, k) for t in qkv.chunk(3, dim=-1))
        decay = self._log_decay(f_down)
        # The gates' bits must not depend on the rows around them (a verify row is a decode row's twin):
        # torch's vectorised sigmoid/softplus give a lone row's scalar tail other bits (pointwise). With the
        # C library, C's sigmoid (as the fused decode layer's).
        beta = row_sigmoid(b.float()) if _c_gates(b) else row_invariant(torch.sigmoid, b.float())
        core = self._recurrence(q, k_, v, decay, beta, layout, pool.recurrent[self.layer_idx])
        gate = self.g_b_proj(g_down).view(n, h, k)
        out = gated_rms_norm(core, gate, self.o_norm_weight, self.eps).reshape(n, h * k)
        return self.o_proj(out.to(x.dtype))

    def _log_decay(self, f_down: torch.Tensor) -> torch.Tensor:
        """Per-channel log forget gate ``[N, H, K]`` fp32: ``-exp(A_log) · softplus(f + dt_bias)``; the decode
        rows' through the C function the fused decode layer calls, where the C gates run."""
        f = self.f_b_proj(f_down).float()
        neg_a = -self.A_log.float().exp()
        decode = decode_rows(f.shape[0]) if _c_gates(f) else 0
        if decode == 0:
            return self._torch_decay(f, neg_a)
        leading = native_kda_layer.softplus_decay(f[:decode], self.dt_bias, neg_a)
        if decode == f.shape[0]:
            return leading
        with rows_of_kind(decode=False):
            return torch.cat([leading, self._torch_decay(f[decode:], neg_a)])

    def _torch_decay(self, f: torch.Tensor, neg_a: torch.Tensor) -> torch.Tensor:
        f = (f + self.dt_bias.float()).view(f.shape[0], self.num_heads, self.head_dim)
        return neg_a[:, None] * row_invariant(partial(F.softplus, threshold=20.0), f)

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


def _c_gates(x: torch.Tensor) -> bool:
    """Whether the gates of ``x``'s rows run through the C functions (eagerly on the CPU, under a backend
    that runs C kernels, with the library built; a compiled graph keeps torch's, which inductor fuses)."""
    return (
        x.device.type == "cpu" and not torch.compiler.is_compiling() and uses_native() and native_kda_layer.available()
    )
