"""Which states the engine copies out for checkpoints after a step, and the copies themselves."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from metrale.worker.model.interface import SequenceState
from metrale.worker.request import Request
from metrale.worker.scheduler.plan import ChunkPlan, SequenceUpdate

Export = Callable[[int, Sequence[int], int], SequenceState]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The exact state of a request after consuming ``consumed`` (prompt, then output tokens).

    ``final`` marks the snapshot taken when the request finished: the state after its last consumed
    token (the last sampled token is never consumed).
    """

    request_id: str
    consumed: tuple[int, ...]
    state: SequenceState
    final: bool


class SnapshotTaker:
    """Copies out states at prompt checkpoint positions (grid multiples and marks) and at the end.

    Only choice 0 of requests that asked for ``snapshots``; each position once per request (a
    restarted prefill passes the same positions again).
    """

    def __init__(self, grid: int | None) -> None:
        self.grid = grid
        self._taken: dict[str, set[int]] = {}

    def forget(self, request_id: str) -> None:
        self._taken.pop(request_id, None)

    def collect(
        self,
        requests: dict[str, Request],
        chunks: Sequence[ChunkPlan],
        updates: Sequence[SequenceUpdate],
        export: Export,
    ) -> list[Snapshot]:
        """Snapshots of this step; must run before the next forward (freed slots still hold state)."""
        taken = []
        for chunk in chunks:
            request = requests.get(chunk.seq_id.request_id)
            if request is not None and chunk.seq_id.choice == 0 and self._wanted(request, chunk):
                state = export(chunk.slot, chunk.block_ids, chunk.end)
                taken.append(Snapshot(request.request_id, request.prompt_ids[: chunk.end], state, final=False))
        for update in updates:
            request = requests.get(update.seq_id.request_id)
            final = update.final_state
            if request is None or not request.snapshots or update.seq_id.choice != 0 or final is None:
                continue
            state = export(final.slot, final.block_ids, final.length)
            taken.append(Snapshot(request.request_id, final.consumed, state, final=True))
        return taken

    def _wanted(self, request: Request, chunk: ChunkPlan) -> bool:
        end = chunk.end
        if not request.snapshots or chunk.is_decode or end >= len(request.prompt_ids):
            return False
        on_grid = self.grid is not None and end % self.grid == 0
        if not (on_grid or end in request.checkpoint_marks):
            return False
        done = self._taken.setdefault(request.request_id, set())
        if end in done:
            return False
        done.add(end)
        return True
