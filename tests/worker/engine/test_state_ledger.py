from __future__ import annotations

from collections.abc import Callable

import pytest

from metrale.worker.engine.state_ledger import FedChunk, LedgerEntry, StateInvariantError, StateLedger
from metrale.worker.scheduler.sequence import SequenceId

A, B = SequenceId("a", 0), SequenceId("b", 0)


def fed(owner: SequenceId, slot: int, start: int, length: int) -> FedChunk:
    return FedChunk(owner, slot, start, length)


def test_chunks_continue_exactly_where_the_state_stopped() -> None:
    ledger = StateLedger()
    ledger.feed([fed(A, 0, 0, 4), fed(B, 1, 0, 2)])
    ledger.feed([fed(A, 0, 4, 1), fed(B, 1, 2, 3)])
    assert ledger.slot_entry(0) == LedgerEntry(A, 5) and ledger.slot_entry(1) == LedgerEntry(B, 5)


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (fed(A, 0, 3, 1), "expects slot 0 at position 3; it holds .* at 4"),
        (fed(A, 0, 5, 1), "at position 5"),
        (fed(B, 0, 4, 1), "expects slot 0"),
        (fed(A, 1, 4, 1), "it holds nothing"),
        (fed(A, 0, 4, 0), "empty chunk"),
    ],
    ids=["rerun-a-position", "skip-a-position", "someone-elses-state", "wrong-slot", "empty"],
)
def test_out_of_order_feeds_are_refused(chunk: FedChunk, message: str) -> None:
    ledger = StateLedger()
    ledger.feed([fed(A, 0, 0, 4)])
    with pytest.raises(StateInvariantError, match=message):
        ledger.feed([chunk])


def test_start_zero_resets_whatever_the_slot_held() -> None:
    ledger = StateLedger()
    ledger.feed([fed(A, 0, 0, 4)])
    ledger.feed([fed(B, 0, 0, 2)])
    assert ledger.slot_entry(0) == LedgerEntry(B, 2)
    with pytest.raises(StateInvariantError):
        ledger.feed([fed(A, 0, 4, 1)])


def test_a_slot_is_fed_once_per_forward() -> None:
    ledger = StateLedger()
    with pytest.raises(StateInvariantError, match="fed twice"):
        ledger.feed([fed(A, 0, 0, 2), fed(B, 0, 0, 2)])


def test_swapped_state_comes_back_into_any_slot_at_its_position() -> None:
    ledger = StateLedger()
    ledger.feed([fed(A, 0, 0, 4)])
    ledger.swap_out(A, slot=0, length=4)
    assert ledger.slot_entry(0) is None and ledger.parked_position(A) == 4
    ledger.swap_in(A, slot=3, length=4)
    ledger.feed([fed(A, 3, 4, 1)])
    assert ledger.slot_entry(3) == LedgerEntry(A, 5)


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda ledger: ledger.swap_out(A, slot=0, length=3), "at position 3"),
        (lambda ledger: ledger.swap_out(B, slot=0, length=4), "expects slot 0"),
        (lambda ledger: ledger.swap_in(B, slot=1, length=4), "parked state is at None"),
    ],
    ids=["swap-out-wrong-length", "swap-out-wrong-owner", "swap-in-nothing-parked"],
)
def test_bad_swaps_are_refused(action: Callable[[StateLedger], None], message: str) -> None:
    ledger = StateLedger()
    ledger.feed([fed(A, 0, 0, 4)])
    with pytest.raises(StateInvariantError, match=message):
        action(ledger)


def test_swap_in_at_a_different_length_is_refused() -> None:
    ledger = StateLedger()
    ledger.feed([fed(A, 0, 0, 4)])
    ledger.swap_out(A, slot=0, length=4)
    with pytest.raises(StateInvariantError, match="swaps in at 5"):
        ledger.swap_in(A, slot=0, length=5)


def test_fork_copies_the_parent_position_to_a_slot_or_host() -> None:
    ledger = StateLedger()
    child_in_slot, child_parked = SequenceId("a", 1), SequenceId("a", 2)
    ledger.feed([fed(A, 0, 0, 4)])
    ledger.fork(A, slot=0, length=4, child=child_in_slot, child_slot=1)
    ledger.fork(A, slot=0, length=4, child=child_parked, child_slot=None)
    assert ledger.slot_entry(1) == LedgerEntry(child_in_slot, 4)
    assert ledger.parked_position(child_parked) == 4
    with pytest.raises(StateInvariantError):
        ledger.fork(A, slot=0, length=3, child=SequenceId("a", 3), child_slot=2)


def test_forget_drops_a_request_everywhere() -> None:
    ledger = StateLedger()
    ledger.feed([fed(A, 0, 0, 4), fed(B, 1, 0, 4)])
    ledger.fork(A, slot=0, length=4, child=SequenceId("a", 1), child_slot=None)
    ledger.forget("a")
    assert ledger.slot_entry(0) is None and ledger.parked_position(SequenceId("a", 1)) is None
    assert not ledger.is_empty
    ledger.forget("b")
    assert ledger.is_empty
