"""Host swap space accounting, in bytes, keyed by the sequence that owns the parked state."""

from __future__ import annotations

from metrale.worker.scheduler.sequence import SequenceId


class SwapSpace:
    """Tracks how many bytes of host memory each swapped-out state takes.

    Keyed by ``SequenceId`` and never by slot: a state swapped out of one slot may come back into any.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._held: dict[SequenceId, int] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def can_hold(self, nbytes: int) -> bool:
        return self._used + nbytes <= self.capacity_bytes

    def reserve(self, seq_id: SequenceId, nbytes: int) -> None:
        """Account ``nbytes`` for ``seq_id``'s parked state."""
        if seq_id in self._held:
            raise ValueError(f"{seq_id} already holds swap space")
        if not self.can_hold(nbytes):
            raise ValueError(f"{nbytes} bytes for {seq_id} exceed the free swap space")
        self._held[seq_id] = nbytes
        self._used += nbytes

    def release(self, seq_id: SequenceId) -> int:
        """Free ``seq_id``'s bytes; return how many there were."""
        nbytes = self._held.pop(seq_id)
        self._used -= nbytes
        return nbytes
