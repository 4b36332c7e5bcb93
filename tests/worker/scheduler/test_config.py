from __future__ import annotations

import pytest

from metrale.worker.scheduler.config import SchedulerConfig, blocks_for


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "blocks"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (7, 1, 7)],
    ids=["empty", "one-token", "exactly-one-block", "spills-over", "block-size-one"],
)
def test_blocks_for_rounds_up(num_tokens: int, block_size: int, blocks: int) -> None:
    assert blocks_for(num_tokens, block_size) == blocks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_seqs": 0}, "max_seqs must be >= 1"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"watermark": -1}, "watermark must be >= 0"),
        ({"swap_space_bytes": -1}, "swap_space_bytes must be >= 0"),
        ({"checkpoint_grid": 0}, "checkpoint_grid must be >= 1"),
        ({"max_batch_tokens": 4, "max_seqs": 8}, "must be >= max_seqs"),
        ({"num_blocks": 3, "block_size": 4, "max_model_len": 16}, "must hold one sequence"),
        ({"num_blocks": 4, "block_size": 4, "max_model_len": 16, "watermark": 1}, "plus the watermark"),
    ],
    ids=[
        "no-seqs",
        "zero-block-size",
        "negative-watermark",
        "negative-swap",
        "zero-grid",
        "budget-below-seq-cap",
        "longest-sequence-does-not-fit",
        "watermark-leaves-no-room",
    ],
)
def test_invalid_settings_are_refused(overrides: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**overrides)


def test_defaults_are_valid_and_frozen() -> None:
    config = SchedulerConfig()
    with pytest.raises(AttributeError):
        config.max_seqs = 2  # type: ignore[misc]
