"""Feed-forward blocks: the dense SwiGLU MLP, the routed experts any mixture of experts runs, and Kimi's
grouped-routing mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.worker.kernels.native import router as native_router
from metrale.worker.kernels.native import swiglu as native_swiglu
from metrale.worker.kernels.pointwise import row_invariant
from metrale.worker.kernels.products import bmm, decode_rows, linear, one_order_rows, row_sigmoid, rows_of_kind
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.layers.linear import Linear

PADDED_EXPERTS_MAX_PAIRS = 512
"""Up to this many (token, expert) pairs the routed experts run as one padded batched product: at decode
batch sizes a run per expert is a handful of rows, and one call over all experts beats a call each."""

PADDED_EXPERTS_MIN_PAIRS_PER_EXPERT = 1
"""...but only with more pairs than this many per expert: the padded product reads every expert's weights,
so a batch that selects few experts (one stream: ``top_k`` of them) runs only those, one product each."""


class DenseMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))`` with gate and up fused into ``gate_up`` ``[2·I, D]``.

    The decode rows run as one C call where the one-order products would take them (``native.swiglu``:
    the same products, SiLU in C); :meth:`plain` is the torch twin, which the other rows take."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = Linear(hidden_size, 2 * intermediate_size)
        self.down = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` -> ``[..., D]``."""
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1])).view(x.shape)
        decode = one_order_rows(x, self.gate_up.weight)
        if decode == 0 or not native_swiglu.supports(x, self.gate_up.weight, self.down.weight):
            return self.plain(x)
        out = native_swiglu.swiglu(x[:decode], self.gate_up.weight, self.down.weight)
        if decode == x.shape[0]:
            return out
        with rows_of_kind(decode=False):
            return torch.cat([out, self.plain(x[decode:])])

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` op by op in torch."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(row_invariant(F.silu, gate) * up)


class RoutedExperts(nn.Module):
    """``num_experts`` SwiGLU experts, each token through the ``top_k`` a router chose for it, weighted.

    ``experts_gate_up`` ``[E, 2·I, D]``, ``experts_down`` ``[E, D, I]``. A mixture of experts subclasses
    this with its router (``route``) and its shared experts; :meth:`run_experts` picks the execution path
    for the batch: a compiled decode step's static shapes, decode rows in one C call where the one-order
    products would take them (``native.swiglu``), one stream's row, or the sorted runs of a batch.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[:, j] * expert_{ids[:, j]}(x)``: ``x [N, D]``, ``ids, weights [N, top_k]`` -> ``[N, D]``."""
        if torch.compiler.is_compiling():  # a compiled decode step (model.decode_graph): static shapes
            return self._gathered_experts(x, ids, weights)
        decode = decode_rows(x.shape[0])
        if 0 < decode < x.shape[0]:  # a forward's decode rows and prefill rows: never in one expert run
            with rows_of_kind(decode=True):
                leading = self.run_experts(x[:decode], ids[:decode], weights[:decode])
            with rows_of_kind(decode=False):
                return torch.cat([leading, self.run_experts(x[decode:], ids[decode:], weights[decode:])])
        if (
            decode
            and one_order_rows(x, self.experts_gate_up)
            and native_swiglu.supports(x, self.experts_gate_up, self.experts_down)
        ):
            return native_swiglu.routed_experts(x, ids, weights, self.experts_gate_up, self.experts_down)
        if x.shape[0] == 1:
            return self._one_row_experts(x, ids, weights)
        return self._routed_experts(x, ids, weights)

    def _routed_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[:, j] * expert_{ids[:, j]}(x)``: ``x [N, D]``, ``ids, weights [N, top_k]`` -> ``[N, D]``.

        The (token, expert) pairs are sorted by expert once; a token's contributions are summed in expert
        order. Few rows per expert (decode batches) run all experts as one padded batched product; many
        rows, or so few that most experts have none, one product per selected expert (``_expert_runs``,
        the plain twin).
        """
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.experts_gate_up.shape[0])
        tokens = order // self.top_k
        routed_x = x[tokens]
        pairs, num_experts = flat_ids.numel(), self.experts_gate_up.shape[0]
        if num_experts * PADDED_EXPERTS_MIN_PAIRS_PER_EXPERT < pairs <= PADDED_EXPERTS_MAX_PAIRS:
            routed_y = self._padded_experts(routed_x, counts)
        else:
            routed_y = self._expert_runs(routed_x, counts.tolist(), batched=x.shape[0] > 1)
        # The routing weights are fp32, so the weighted rows are too: they are summed in fp32 and rounded
        # once (a bf16 index_add_ would round every partial sum).
        weighted = routed_y * weights.flatten()[order].unsqueeze(1)
        return torch.zeros(x.shape, dtype=weighted.dtype, device=x.device).index_add_(0, tokens, weighted).to(x.dtype)

    def _one_row_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``_routed_experts`` for one row (one stream's decode step), bit for bit: its ``top_k`` experts
        in expert order, weighted in fp32 and summed in that order, without the sorting and scattering
        a batch needs. ``x [1, D]``, ``ids, weights [1, top_k]`` -> ``[1, D]``."""
        total: torch.Tensor | None = None
        for expert, j in sorted(zip(ids[0].tolist(), range(ids.shape[1]), strict=True)):
            gate, up = linear(x, self.experts_gate_up[expert]).chunk(2, dim=-1)
            weighted = linear(F.silu(gate) * up, self.experts_down[expert]) * weights[:, j : j + 1]
            total = weighted if total is None else total + weighted
        assert total is not None, "top_k >= 1"
        return total.to(x.dtype)

    def _gathered_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``_routed_experts`` in static shapes, for a compiled decode step: each row's ``top_k`` experts
        as products over their weights indexed by ``ids`` — compiled, the gather is fused into the
        product's loop, so only the selected experts are read and nothing is copied (run eagerly it would
        materialize ``[N, top_k, 2·I, D]``: small batches only). Weighted in fp32 and summed over ``top_k``.
        Equal to ``_routed_experts`` to rounding (the products' summation order differs; tested).
        ``x [N, D]``, ``ids, weights [N, top_k]`` -> ``[N, D]``."""
        gate, up = (self.experts_gate_up[ids] * x[:, None, None, :]).sum(-1).chunk(2, dim=-1)  # [N, k, I]
        routed_y = (self.experts_down[ids] * (F.silu(gate) * up)[:, :, None, :]).sum(-1)  # [N, k, D]
        return (routed_y * weights.unsqueeze(-1)).sum(1).to(x.dtype)

    def _expert_runs(self, routed_x: torch.Tensor, counts: list[int], batched: bool) -> torch.Tensor:
        """Rows ``routed_x [M, D]`` sorted by expert (``counts[e]`` rows each) through their experts, one
        contiguous run per expert. ``batched`` (the rows of more than one token): a run of one row is a
        batch's product too (``products.linear``), so a row gets the same bits however many rows share
        its expert; one token's runs keep the one-row product, as ``_one_row_experts``."""
        routed_y = torch.empty_like(routed_x)
        start = 0
        for expert, count in enumerate(counts):
            rows = slice(start, start + count)
            start += count
            if count:
                gate, up = linear(routed_x[rows], self.experts_gate_up[expert], batched=batched).chunk(2, dim=-1)
                routed_y[rows] = linear(F.silu(gate) * up, self.experts_down[expert], batched=batched)
        return routed_y

    def _padded_experts(self, routed_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``_expert_runs`` as two batched products over ``[E, max(counts), D]``, the runs zero-padded."""
        num_experts = counts.numel()
        starts = counts.cumsum(0) - counts
        expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=counts.device), counts)
        rank = torch.arange(routed_x.shape[0], device=counts.device) - starts[expert_of_row]
        padded = routed_x.new_zeros(num_experts, int(counts.max()), routed_x.shape[1])
        padded[expert_of_row, rank] = routed_x
        gate, up = bmm(padded, self.experts_gate_up.transpose(1, 2)).chunk(2, dim=-1)
        out = bmm(F.silu(gate) * up, self.experts_down.transpose(1, 2))
        return out[expert_of_row, rank]


class MoE(RoutedExperts):
    """Routed experts (sigmoid scores, grouped top-k, optional renormalization, scaled) plus shared experts
    (Kimi Linear).

    ``experts_gate_up`` ``[E, 2·I, D]``, ``experts_down`` ``[E, D, I]``, ``router_weight`` ``[E, D]``,
    ``router_bias`` ``[E]`` (the score-correction bias, used for choosing experts only).
    """

    def __init__(self, config: ModelConfig) -> None:
        e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        super().__init__(e, d, i, config.num_experts_per_token)
        self.num_groups, self.topk_group = config.num_expert_group, config.topk_group
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        self.router_weight = nn.Parameter(torch.empty(e, d))
        self.router_bias = nn.Parameter(torch.zeros(e))
        self.shared = DenseMLP(d, i * config.num_shared_experts) if config.num_shared_experts > 0 else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, D]`` → (expert ids ``[N, top_k]``, weights ``[N, top_k]`` fp32). The decode rows are
        routed in one C call where the one-order products would take them (``native.router``), the other
        rows by :meth:`plain_route`."""
        decode = one_order_rows(x, self.router_weight)
        if decode == 0 or not native_router.supports(x, self.router_weight):
            return self.plain_route(x)
        ids, weights = native_router.sigmoid_route(
            x[:decode],
            self.router_weight,
            self.router_bias,
            num_groups=self.num_groups,
            topk_group=self.topk_group,
            top_k=self.top_k,
            renormalize=self.renormalize,
            scaling=self.scaling,
        )
        if decode == x.shape[0]:
            return ids, weights
        with rows_of_kind(decode=False):
            rest_ids, rest_weights = self.plain_route(x[decode:])
        return torch.cat([ids, rest_ids]), torch.cat([weights, rest_weights])

    def plain_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`route` op by op in torch."""
        scores = row_sigmoid(linear(x.float(), self.router_weight.float()))
        choice = scores + self.router_bias.float()
        if self.topk_group < self.num_groups:  # else every group is kept: nothing to mask
            choice = self._mask_groups(choice)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` ``[N, E]`` with the experts outside each row's ``topk_group`` best groups at ``-inf``
        (a group's score: the sum of its two best experts)."""
        n, e = choice.shape
        grouped = choice.view(n, self.num_groups, e // self.num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        return choice.masked_fill(~group_mask.repeat_interleave(e // self.num_groups, dim=1), float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.run_experts(x, ids, weights)
        if self.shared is not None:
            out = out + self.shared(x)
        return out
