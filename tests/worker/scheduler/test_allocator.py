from __future__ import annotations

import pytest

from metrale.worker.scheduler.allocator import Allocator
from metrale.worker.scheduler.sequence import Priority, Sequence, SequenceId, StopParams


def make_seq(name: str) -> Sequence:
    return Sequence(SequenceId(name, 0), [1], StopParams(max_tokens=4), Priority.INTERACTIVE, arrival=0)


def test_enter_gives_a_slot_and_blocks_covering_the_tokens() -> None:
    allocator = Allocator(num_slots=2, num_blocks=8, block_size=4, watermark=0)
    seq = make_seq("a")
    allocator.enter(seq, num_tokens=9)
    assert seq.slot is not None
    assert len(seq.block_ids) == 3
    assert (allocator.free_slots, allocator.free_blocks) == (1, 5)


def test_grow_adds_only_missing_blocks() -> None:
    allocator = Allocator(num_slots=1, num_blocks=8, block_size=4, watermark=0)
    seq = make_seq("a")
    allocator.enter(seq, num_tokens=4)
    allocator.grow(seq, num_tokens=4)
    assert len(seq.block_ids) == 1
    allocator.grow(seq, num_tokens=5)
    assert len(seq.block_ids) == 2
    assert len(set(seq.block_ids)) == 2


@pytest.mark.parametrize(
    ("watermark", "fits"), [(0, True), (1, True), (2, False)], ids=["no-mark", "mark-just-fits", "mark-blocks"]
)
def test_watermark_is_kept_free_on_entry(watermark: int, fits: bool) -> None:
    allocator = Allocator(num_slots=2, num_blocks=4, block_size=2, watermark=watermark)
    assert allocator.can_enter(num_tokens=6) is fits  # 3 of the 4 blocks


def test_growth_may_use_the_watermark() -> None:
    allocator = Allocator(num_slots=1, num_blocks=4, block_size=2, watermark=2)
    seq = make_seq("a")
    allocator.enter(seq, num_tokens=4)
    assert allocator.can_grow(seq, num_tokens=8)
    allocator.grow(seq, num_tokens=8)
    assert allocator.free_blocks == 0
    assert not allocator.can_grow(seq, num_tokens=9)


def test_entry_needs_a_free_slot() -> None:
    allocator = Allocator(num_slots=1, num_blocks=8, block_size=4, watermark=0)
    allocator.enter(make_seq("a"), num_tokens=1)
    assert not allocator.can_enter(num_tokens=1)
    with pytest.raises(ValueError, match="no room"):
        allocator.enter(make_seq("b"), num_tokens=1)


def test_free_returns_everything_and_refuses_a_double_free() -> None:
    allocator = Allocator(num_slots=2, num_blocks=6, block_size=2, watermark=0)
    seq = make_seq("a")
    allocator.enter(seq, num_tokens=5)
    held_slot, held_blocks = seq.slot, list(seq.block_ids)
    allocator.free(seq)
    assert (seq.slot, seq.block_ids) == (None, [])
    assert (allocator.free_slots, allocator.free_blocks) == (2, 6)
    seq.slot, seq.block_ids = held_slot, held_blocks
    with pytest.raises(ValueError, match="freed twice"):
        allocator.free(seq)


def test_two_sequences_never_share_a_slot_or_block() -> None:
    allocator = Allocator(num_slots=3, num_blocks=9, block_size=1, watermark=0)
    seqs = [make_seq(name) for name in "abc"]
    for seq in seqs:
        allocator.enter(seq, num_tokens=3)
    assert len({seq.slot for seq in seqs}) == 3
    assert len({block for seq in seqs for block in seq.block_ids}) == 9
