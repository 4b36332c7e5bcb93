"""An independent record of what every state slot holds, checked before the model touches it.

The scheduler decides; the ledger only watches what the runner actually feeds, swaps, imports and
forks, and refuses anything that would make a recurrent state consume a position twice, skip one,
or continue someone else's tokens. It shares no arithmetic with the scheduler on purpose.

A verify chunk (speculative decoding) feeds a pending token and draft tokens, each row's state derived
once from the previous row's; it leaves its slot *unsettled* until ``settle`` says how many of its
rows the state keeps. The rows past that are dropped with their states, never consumed by the state
that goes on, so no position is consumed twice: the next feed must start exactly where the kept rows
end, and nothing else may touch an unsettled slot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from metrale.worker.scheduler.sequence import SequenceId


class StateInvariantError(RuntimeError):
    """A state would be fed, moved or copied out of order: a bug, never a condition to continue from."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """``owner``'s state, which has consumed positions ``[0, position)``."""

    owner: SequenceId
    position: int


@dataclass(frozen=True, slots=True)
class FedChunk:
    """What one row of a forward feeds: ``length`` tokens from ``start`` into ``owner``'s ``slot``."""

    owner: SequenceId
    slot: int
    start: int
    length: int
    verify: bool = False


class StateLedger:
    """Per slot: its owner and the next position its state expects; per parked state: the same."""

    def __init__(self) -> None:
        self._slots: dict[int, LedgerEntry] = {}
        self._parked: dict[SequenceId, int] = {}
        self._unsettled: dict[int, FedChunk] = {}

    def slot_entry(self, slot: int) -> LedgerEntry | None:
        return self._slots.get(slot)

    def parked_position(self, owner: SequenceId) -> int | None:
        return self._parked.get(owner)

    @property
    def is_empty(self) -> bool:
        """True when no slot and no parked state is recorded."""
        return not self._slots and not self._parked and not self._unsettled

    def feed(self, chunks: Iterable[FedChunk]) -> None:
        """Check and record one forward. Each chunk starts at 0 (a fresh state, whatever the slot
        held) or exactly where its owner's state in that slot stopped; no slot appears twice."""
        seen: set[int] = set()
        for chunk in chunks:
            if chunk.slot in seen:
                raise StateInvariantError(f"slot {chunk.slot} fed twice in one forward")
            seen.add(chunk.slot)
            if chunk.length < 1:
                raise StateInvariantError(f"empty chunk for {chunk.owner} in slot {chunk.slot}")
            if chunk.start != 0 or chunk.verify:
                self._expect(chunk.slot, chunk.owner, chunk.start)
            self._unsettled.pop(chunk.slot, None)  # a fresh chunk (start 0) may take over an unsettled slot
            if chunk.verify:
                self._unsettled[chunk.slot] = chunk
                self._slots[chunk.slot] = LedgerEntry(chunk.owner, chunk.start)
            else:
                self._slots[chunk.slot] = LedgerEntry(chunk.owner, chunk.start + chunk.length)

    def settle(self, owner: SequenceId, slot: int, rows: int) -> None:
        """Record that ``owner``'s state in ``slot`` keeps the first ``rows`` rows of its verify chunk."""
        chunk = self._unsettled.get(slot)
        if chunk is None or chunk.owner != owner:
            raise StateInvariantError(f"{owner} settles slot {slot}, which holds no verify chunk of its own")
        if not 1 <= rows <= chunk.length:
            raise StateInvariantError(f"{owner} keeps {rows} rows of a verify chunk of {chunk.length}")
        del self._unsettled[slot]
        self._slots[slot] = LedgerEntry(owner, chunk.start + rows)

    def swap_out(self, owner: SequenceId, slot: int, length: int) -> None:
        """Record ``owner``'s state (``length`` tokens) leaving ``slot`` for host memory."""
        self._expect(slot, owner, length)
        if owner in self._parked:
            raise StateInvariantError(f"{owner} already has a parked state")
        del self._slots[slot]
        self._parked[owner] = length

    def resume(self, owner: SequenceId, length: int) -> None:
        """Record a verified checkpoint (the state after ``length`` tokens) parked for ``owner``."""
        if owner in self._parked or any(entry.owner == owner for entry in self._slots.values()):
            raise StateInvariantError(f"{owner} already has a state; a checkpoint cannot replace it")
        self._parked[owner] = length

    def swap_in(self, owner: SequenceId, slot: int, length: int) -> None:
        """Record ``owner``'s parked state (``length`` tokens) entering ``slot``."""
        parked = self._parked.get(owner)
        if parked != length:
            raise StateInvariantError(f"{owner} swaps in at {length}, but its parked state is at {parked}")
        del self._parked[owner]
        self._slots[slot] = LedgerEntry(owner, length)

    def fork(self, parent: SequenceId, slot: int, length: int, child: SequenceId, child_slot: int | None) -> None:
        """Record a copy of ``parent``'s state (``length`` tokens, in ``slot``) becoming ``child``'s,
        in ``child_slot`` or, when None, parked in host memory."""
        self._expect(slot, parent, length)
        if child_slot is None:
            if child in self._parked:
                raise StateInvariantError(f"{child} already has a parked state")
            self._parked[child] = length
        else:
            self._slots[child_slot] = LedgerEntry(child, length)

    def forget(self, request_id: str) -> None:
        """Drop every slot entry and parked state of a request that finished or was aborted."""
        for owner in [owner for owner in self._parked if owner.request_id == request_id]:
            del self._parked[owner]
        for slot in [slot for slot, entry in self._slots.items() if entry.owner.request_id == request_id]:
            del self._slots[slot]
            self._unsettled.pop(slot, None)

    def _expect(self, slot: int, owner: SequenceId, position: int) -> None:
        if slot in self._unsettled:
            raise StateInvariantError(f"slot {slot} holds an unsettled verify chunk of {self._unsettled[slot].owner}")
        entry = self._slots.get(slot)
        if entry is None or entry.owner != owner or entry.position != position:
            held = "nothing" if entry is None else f"{entry.owner} at {entry.position}"
            raise StateInvariantError(f"{owner} expects slot {slot} at position {position}; it holds {held}")
