"""The model as the engine sees it: weights plus state pools behind the ``StatefulModel`` interface."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from metrale.worker.kernels.products import forward_rows
from metrale.worker.model.batch import BatchLayout, VerifyRows
from metrale.worker.model.decode_graph import DecodeGraph
from metrale.worker.model.families.family import FamilyConfig, FamilyModel
from metrale.worker.model.families.kimi_linear import KimiLinearModel
from metrale.worker.model.interface import ForwardChunk, SequenceState
from metrale.worker.model.state import StatePool


class ModelExecutor:
    """Owns a family's decoder (``FamilyModel``) and its :class:`StatePool`; implements ``StatefulModel``."""

    def __init__(
        self,
        model: FamilyModel,
        *,
        num_slots: int = 64,
        num_blocks: int = 1024,
        block_size: int = 16,
        decode_buckets: Sequence[int] | None = None,
    ) -> None:
        """``decode_buckets``: batch sizes whose decode steps run a compiled graph (``DecodeGraph``,
        compiled on first use or by :meth:`warm_up`; Kimi Linear only for now); None runs every step eagerly."""
        self.model = model.eval()
        self.device = model.embed_tokens.weight.device
        self.pool = StatePool(model.config, num_slots, num_blocks, block_size, model.weight_dtype, self.device)
        self.decode_graph: DecodeGraph | None = None
        if decode_buckets is not None:
            if not isinstance(model, KimiLinearModel):
                raise ValueError(
                    f"a compiled decode step (--compile) runs kimi_linear models only, not {model.config.family}"
                )
            self.decode_graph = DecodeGraph(model, self.pool, decode_buckets)
        self._verified: VerifyRows | None = None
        """The verify rows of the last forward, until every one of their slots is settled."""
        self._unsettled: set[int] = set()

    @property
    def config(self) -> FamilyConfig:
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
        """Logits fp32 of each chunk's last token, or of all its tokens (``every_row``), chunk by chunk
        in the order given (the LM head runs in the weight dtype; sampling gets fp32). ``verify`` chunks
        return every row's logits and leave their slots unsettled (``settle_verified``)."""
        if self._unsettled:
            raise RuntimeError(f"slots {sorted(self._unsettled)} were verified but never settled")
        if self.decode_graph is not None and self.decode_graph.runs(chunks):
            return self.decode_graph.forward(chunks).float().cpu()
        layout = BatchLayout.build(chunks, self.pool.block_size, self.device)
        if layout.verify is not None:
            self._verified = layout.verify
            self._unsettled = {chunk.slot for chunk in chunks if chunk.verify}
        if any(chunk.every_row or chunk.verify for chunk in chunks):
            rows, to_callers = _every_row_rows(chunks, layout)
            with forward_rows(layout.num_rows, layout.num_decode, rows):
                logits = self.model(layout, self.pool, rows).float()
            return (logits if to_callers is None else logits[to_callers.to(logits.device)]).cpu()
        with forward_rows(layout.num_rows, layout.num_decode, layout.last_rows):
            logits = self.model(layout, self.pool, layout.last_rows).float()
        if all(i == j for j, i in enumerate(layout.order)):  # already the caller's order (one stream: always)
            return logits.cpu()
        inverse = torch.empty(len(layout.order), dtype=torch.long)
        inverse[torch.tensor(layout.order)] = torch.arange(len(layout.order))
        return logits[inverse.to(logits.device)].cpu()

    def settle_verified(self, slot: int, rows: int) -> None:
        """Keep the state after ``rows`` tokens of the last forward's verify chunk in ``slot``."""
        if self._verified is None or slot not in self._unsettled:
            raise RuntimeError(f"slot {slot} has no verify chunk to settle")
        self._verified.settle(slot, rows)
        self._unsettled.discard(slot)
        if not self._unsettled:
            self._verified = None

    def copy_slot(self, source: int, target: int) -> None:
        """Slot ``target`` holds what slot ``source`` holds (its recurrent state; see ``StatePool.copy_slot``)."""
        if source in self._unsettled or target in self._unsettled:
            raise RuntimeError(f"slot {source} or {target} was verified but never settled")
        self.pool.copy_slot(source, target)

    def warm_up(self) -> dict[int, float]:
        """Compile the decode graph of every bucket now; wall seconds per bucket (none without a graph)."""
        return {} if self.decode_graph is None else self.decode_graph.warm_up()

    def export_state(self, slot: int, block_ids: Sequence[int], length: int) -> SequenceState:
        return self.pool.export(slot, block_ids, length)

    def import_state(self, state: SequenceState, slot: int, block_ids: Sequence[int]) -> None:
        self.pool.import_(state, slot, block_ids)

    def state_nbytes(self, length: int) -> int:
        return self.pool.nbytes(length)


def _every_row_rows(chunks: Sequence[ForwardChunk], layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layout's rows whose logits ``forward`` returns, in the layout's order — every row of an
    ``every_row`` or ``verify`` chunk (a verify chunk's rows are one-row sequences of the layout), the last
    row of any other — and the permutation (int64 ``[R]``) that puts their logits in the caller's order:
    chunk by chunk, a chunk's rows in token order; None where it is the layout's order already.

    The LM head reads the rows in the layout's order, decode and verify rows first, so they are decode rows
    to its product (``forward_rows``) whatever order the caller gave: a verify row's logits are the bits
    of the decode row it stands for."""
    cu = layout.cu_seqlens.tolist()
    rows: list[int] = []
    by_caller: dict[int, list[int]] = {}
    for position, index in enumerate(layout.order):
        start, end = cu[position], cu[position + 1]
        picked = range(start, end) if chunks[index].every_row or chunks[index].verify else [end - 1]
        by_caller.setdefault(index, []).extend(range(len(rows), len(rows) + len(picked)))
        rows.extend(picked)
    to_callers = [i for index in sorted(by_caller) for i in by_caller[index]]
    device = layout.cu_seqlens.device
    unchanged = all(i == j for j, i in enumerate(to_callers))
    rows_tensor = torch.tensor(rows, dtype=torch.long, device=device)
    return rows_tensor, None if unchanged else torch.tensor(to_callers, dtype=torch.long)
