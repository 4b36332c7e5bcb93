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
    ``model_context``, when known, is the model's own context length, which ``max_model_len`` may be
    below (the cache pool or the operator set it lower); it only explains refusals.
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
    model_context: int | None = None

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

    def context_limit(self) -> str:
        """``max_model_len`` with the numbers behind it: what set it and what the cache pool holds, e.g.
        ``65,536 tokens (the cache pool: 4,096 blocks of 16 tokens; the model's context is 131,072)``."""
        pool = self.num_blocks * self.block_size
        pool_words = f"{self.num_blocks:,} blocks of {self.block_size} tokens"
        context = f"the model's context is {self.model_context:,}" if self.model_context is not None else ""
        if self.max_model_len == self.model_context:
            why = f"the model's context; the cache pool holds {pool:,} tokens in {pool_words}"
        elif self.max_model_len == pool:
            why = f"the cache pool: {pool_words}" + (f"; {context}" if context else "")
        else:
            why = f"max_model_len; the cache pool holds {pool:,} tokens" + (f", {context}" if context else "")
        return f"{self.max_model_len:,} tokens ({why})"

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks needed to hold positions ``[0, num_tokens)``."""
        return blocks_for(num_tokens, self.block_size)
