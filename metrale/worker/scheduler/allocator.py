"""State slots and MLA KV blocks: who holds which, and whether a sequence may enter or grow."""

from __future__ import annotations

from metrale.worker.scheduler.config import blocks_for
from metrale.worker.scheduler.sequence import Sequence


class Allocator:
    """Hands out one state slot per running sequence and enough KV blocks for its positions.

    ``watermark`` blocks stay free whenever a sequence enters (``can_enter``); growing an already
    running sequence may use them.
    """

    def __init__(self, num_slots: int, num_blocks: int, block_size: int, watermark: int) -> None:
        self.block_size = block_size
        self.watermark = watermark
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        # Popped from the end: the lowest ids go out first.
        self._free_slots = list(reversed(range(num_slots)))
        self._free_blocks = list(reversed(range(num_blocks)))
        self._slot_used = [False] * num_slots
        self._block_used = [False] * num_blocks

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_enter(self, num_tokens: int) -> bool:
        """Whether a new sequence covering ``num_tokens`` positions fits above the watermark."""
        needed = self.blocks_for(num_tokens)
        return bool(self._free_slots) and self.free_blocks - needed >= self.watermark

    def enter(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` a slot and blocks for positions ``[0, num_tokens)``."""
        if seq.slot is not None or seq.block_ids:
            raise ValueError(f"{seq.seq_id} already holds a slot or blocks")
        if not self.can_enter(num_tokens):
            raise ValueError(f"no room for {seq.seq_id} ({num_tokens} tokens)")
        slot = self._free_slots.pop()
        self._slot_used[slot] = True
        seq.slot = slot
        self.grow(seq, num_tokens)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can cover ``[0, num_tokens)``; growth may use the watermark blocks."""
        return self.blocks_for(num_tokens) - len(seq.block_ids) <= self.free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Add blocks to ``seq`` until they cover ``[0, num_tokens)``."""
        missing = self.blocks_for(num_tokens) - len(seq.block_ids)
        if missing > self.free_blocks:
            raise ValueError(f"{seq.seq_id} needs {missing} blocks, {self.free_blocks} free")
        for _ in range(missing):
            block = self._free_blocks.pop()
            self._block_used[block] = True
            seq.block_ids.append(block)

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s slot and blocks to the pools."""
        for block in seq.block_ids:
            if not self._block_used[block]:
                raise ValueError(f"block {block} freed twice")
            self._block_used[block] = False
            self._free_blocks.append(block)
        seq.block_ids = []
        if seq.slot is not None:
            if not self._slot_used[seq.slot]:
                raise ValueError(f"slot {seq.slot} freed twice")
            self._slot_used[seq.slot] = False
            self._free_slots.append(seq.slot)
            seq.slot = None
