"""The model as the engine sees it: weights plus state pools behind the ``StatefulModel`` interface."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.decode_graph import DecodeGraph
from metrale.worker.model.interface import ForwardChunk, SequenceState
from metrale.worker.model.kimi_linear import KimiLinearModel
from metrale.worker.model.state import StatePool


class ModelExecutor:
    """Owns a :class:`KimiLinearModel` and its :class:`StatePool`; implements ``StatefulModel``."""

    def __init__(
        self,
        model: KimiLinearModel,
        *,
        num_slots: int = 64,
        num_blocks: int = 1024,
        block_size: int = 16,
        decode_buckets: Sequence[int] | None = None,
    ) -> None:
        """``decode_buckets``: batch sizes whose decode steps run a compiled graph (``DecodeGraph``,
        compiled on first use or by :meth:`warm_up`); None runs every step eagerly."""
        self.model = model.eval()
        self.device = model.embed_tokens.weight.device
        self.pool = StatePool(model.config, num_slots, num_blocks, block_size, model.weight_dtype, self.device)
        self.decode_graph = None if decode_buckets is None else DecodeGraph(self.model, self.pool, decode_buckets)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def forward(self, chunks: Sequence[ForwardChunk]) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` fp32 of each chunk's last token, in the order given (the LM
        head runs in the weight dtype; sampling gets fp32)."""
        if self.decode_graph is not None and self.decode_graph.runs(chunks):
            return self.decode_graph.forward(chunks).float().cpu()
        layout = BatchLayout.build(chunks, self.pool.block_size, self.device)
        logits = self.model(layout, self.pool, layout.last_rows).float()
        if all(i == j for j, i in enumerate(layout.order)):  # already the caller's order (one stream: always)
            return logits.cpu()
        inverse = torch.empty(len(layout.order), dtype=torch.long)
        inverse[torch.tensor(layout.order)] = torch.arange(len(layout.order))
        return logits[inverse.to(logits.device)].cpu()

    def warm_up(self) -> dict[int, float]:
        """Compile the decode graph of every bucket now; wall seconds per bucket (none without a graph)."""
        return {} if self.decode_graph is None else self.decode_graph.warm_up()

    def export_state(self, slot: int, block_ids: Sequence[int], length: int) -> SequenceState:
        return self.pool.export(slot, block_ids, length)

    def import_state(self, state: SequenceState, slot: int, block_ids: Sequence[int]) -> None:
        self.pool.import_(state, slot, block_ids)

    def state_nbytes(self, length: int) -> int:
        return self.pool.nbytes(length)
