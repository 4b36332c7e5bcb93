"""Qwen's mixture of experts: a softmax router's top-k routed SwiGLU experts plus one shared expert
scaled by a sigmoid gate (Qwen3.5 MoE, Qwen3-Next)."""

from __future__ import annotations

import torch
from torch import nn

from metrale.worker.kernels.pointwise import row_invariant
from metrale.worker.kernels.products import linear
from metrale.worker.model.layers.linear import Linear
from metrale.worker.model.layers.mlp import DenseMLP, RoutedExperts


class QwenMoE(RoutedExperts):
    """``sum_j w_j · expert_{i_j}(x) + sigmoid(shared_gate(x)) · shared(x)``, where ``i_1..i_k`` are the
    ``top_k`` largest of ``softmax(router(x))`` and ``w_j`` their probabilities, renormalized to sum to 1
    when ``norm_topk_prob`` (Qwen3.5 MoE always; Qwen3-Next by its config).

    ``router_weight`` ``[E, D]``, ``experts_gate_up`` ``[E, 2·I, D]``, ``experts_down`` ``[E, D, I]``,
    ``shared`` a SwiGLU of width ``shared_intermediate_size``, ``shared_gate`` ``[1, D]``. The router
    computes in fp32 (as Kimi's) through :func:`kernels.products.linear`, so a row's expert choice does
    not depend on its batch; the routed experts run through :class:`RoutedExperts`' paths.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, top_k)
        self.norm_topk_prob = norm_topk_prob
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.shared = DenseMLP(hidden_size, shared_intermediate_size)
        self.shared_gate = Linear(hidden_size, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, D]`` → (expert ids ``[N, top_k]``, weights ``[N, top_k]`` fp32)."""
        probs = linear(x.float(), self.router_weight.float()).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, D]`` → ``[N, D]``."""
        ids, weights = self.route(x)
        # The gate is one value a row: torch's sigmoid would take a decode row's in its scalar tail and the
        # same row's among many in its vector body, other bits (pointwise.row_invariant).
        gate = row_invariant(torch.sigmoid, self.shared_gate(x))
        return self.run_experts(x, ids, weights) + gate * self.shared(x)
