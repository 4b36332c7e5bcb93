from __future__ import annotations

import pytest

from metrale.worker.scheduler.sequence import SequenceId
from metrale.worker.scheduler.swap import SwapSpace


def test_reserve_and_release_account_bytes_per_sequence() -> None:
    swap = SwapSpace(capacity_bytes=100)
    a, b = SequenceId("r", 0), SequenceId("r", 1)
    swap.reserve(a, 60)
    swap.reserve(b, 40)
    assert swap.used_bytes == 100 and a in swap and len(swap) == 2
    assert swap.release(a) == 60
    assert swap.used_bytes == 40 and a not in swap


@pytest.mark.parametrize(("held", "asked", "fits"), [(0, 100, True), (50, 50, True), (50, 51, False)])
def test_capacity_is_a_hard_limit(held: int, asked: int, fits: bool) -> None:
    swap = SwapSpace(capacity_bytes=100)
    if held:
        swap.reserve(SequenceId("held", 0), held)
    assert swap.can_hold(asked) is fits
    if not fits:
        with pytest.raises(ValueError, match="exceed"):
            swap.reserve(SequenceId("new", 0), asked)


def test_a_sequence_holds_at_most_one_parked_state() -> None:
    swap = SwapSpace(capacity_bytes=100)
    swap.reserve(SequenceId("r", 0), 10)
    with pytest.raises(ValueError, match="already"):
        swap.reserve(SequenceId("r", 0), 10)


def test_zero_capacity_holds_nothing() -> None:
    assert not SwapSpace(capacity_bytes=0).can_hold(1)
