"""The model's bias-free linear layer, its product through :func:`kernels.products.linear` (bf16 widened
to fp32 on CPUs without bf16 instructions)."""

from __future__ import annotations

import torch
from torch import nn

from metrale.worker.kernels.products import linear


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose product is :func:`kernels.products.linear`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
