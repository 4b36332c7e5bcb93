"""The scheduler's settings: pool sizes, batch limits and prefill alignment."""

from __future__ import annotations

from dataclasses import dataclass


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks needed to hold positions ``[0, num_tokens)``."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How much one step may do and how large the state pools are.

    ``watermark`` blocks are kept free whenever a sequence enters the running set (admission, swap-in,
    fork), so running sequences can still grow. ``swap_space_bytes`` is the host memory for swapped-out
    states; 0 means every preemption restarts. ``checkpoint_grid``, when set, keeps every prefill chunk
    inside one grid cell, so the state at each multiple of the grid is observable between steps.
    """

    max_batch_tokens: int = 2048
    max_seqs: int = 64
    num_slots: int = 64
    num_blocks: int = 1024
    block_size: int = 16
    watermark: int = 0
    swap_space_bytes: int = 0
    max_model_len: int = 4096
    checkpoint_grid: int | None = None

    def __post_init__(self) -> None:
        positive = ("max_batch_tokens", "max_seqs", "num_slots", "num_blocks", "block_size", "max_model_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("watermark", "swap_space_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_grid is not None and self.checkpoint_grid < 1:
            raise ValueError(f"checkpoint_grid must be >= 1 or None, got {self.checkpoint_grid}")
        if self.max_batch_tokens < self.max_seqs:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_seqs ({self.max_seqs}): "
                "every running sequence needs room for its decode row"
            )
        longest = self.blocks_for(self.max_model_len)
        if longest + self.watermark > self.num_blocks:
            raise ValueError(
                f"num_blocks ({self.num_blocks}) must hold one sequence of max_model_len "
                f"({longest} blocks) plus the watermark ({self.watermark})"
            )

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks needed to hold positions ``[0, num_tokens)``."""
        return blocks_for(num_tokens, self.block_size)
