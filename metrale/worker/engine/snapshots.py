"""Which states the engine copies out for checkpoints after a step, and the copies themselves."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from metrale.worker.engine.request import Request
from metrale.worker.model.interface import SequenceState
from metrale.worker.scheduler.plan import ChunkPlan, SequenceUpdate
from metrale.worker.scheduler.sequence import SequenceId

Export = Callable[[int, Sequence[int], int], SequenceState]
"""``(slot, block_ids, length)`` -> a copy of that state (``StatefulModel.export_state``)."""
Tokens = Callable[[SequenceId, int], "tuple[int, ...] | None"]
"""``(sequence, end)`` -> its first ``end`` tokens (prompt, then output), or None once it ended."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The exact state of a request after consuming ``consumed`` (prompt, then output tokens).

    ``final`` marks the snapshot taken when the request finished: the state after its last consumed
    token (the last sampled token is never consumed). ``decode`` marks a snapshot inside the output
    (a decode checkpoint), kept only for resuming the request itself elsewhere.
    """

    request_id: str
    consumed: tuple[int, ...]
    state: SequenceState
    final: bool
    decode: bool = False


class SnapshotTaker:
    """Copies out states at prompt checkpoint positions, decode checkpoints, and at the end.

    Prompt positions are grid multiples and marks; a mark may be the prompt's end (the state after the
    whole prompt, kept like any prompt checkpoint: a session's next turn resumes there). Decode
    checkpoints are the states after the whole prompt plus ``k`` output tokens for every ``k`` that is a
    multiple of ``decode_interval`` (``k = 0`` included: the state after the prompt, when the prompt has
    at least ``decode_interval`` tokens), so a request that loses its worker feeds again at most
    ``decode_interval`` of its output tokens (one per step) after a prompt prefill. The state at the end
    only for requests with ``final_snapshot``. Only choice 0 of requests that asked for ``snapshots``;
    each position once per request (a restarted prefill passes the same positions again).
    """

    def __init__(self, grid: int | None, decode_interval: int | None = None) -> None:
        if decode_interval is not None and decode_interval < 1:
            raise ValueError(f"decode_interval must be >= 1 or None, got {decode_interval}")
        self.grid = grid
        self.decode_interval = decode_interval
        self._taken: dict[str, set[int]] = {}

    def forget(self, request_id: str) -> None:
        self._taken.pop(request_id, None)

    def collect(
        self,
        requests: dict[str, Request],
        chunks: Sequence[ChunkPlan],
        updates: Sequence[SequenceUpdate],
        export: Export,
        tokens: Tokens,
    ) -> list[Snapshot]:
        """Snapshots of this step; must run before the next forward (freed slots still hold state)."""
        taken = []
        for chunk in chunks:
            request = requests.get(chunk.seq_id.request_id)
            if request is None or chunk.seq_id.choice != 0 or not request.snapshots:
                continue
            if self._wanted_in_prompt(request, chunk):
                state = export(chunk.slot, chunk.block_ids, chunk.end)
                taken.append(Snapshot(request.request_id, request.prompt_ids[: chunk.end], state, final=False))
            elif self._wanted_in_output(request, chunk) and (consumed := tokens(chunk.seq_id, chunk.end)):
                state = export(chunk.slot, chunk.block_ids, chunk.end)
                taken.append(Snapshot(request.request_id, consumed, state, final=False, decode=True))
        for update in updates:
            request = requests.get(update.seq_id.request_id)
            final = update.final_state
            if request is None or not (request.snapshots and request.final_snapshot):
                continue
            if update.seq_id.choice != 0 or final is None:
                continue
            state = export(final.slot, final.block_ids, final.length)
            taken.append(Snapshot(request.request_id, final.consumed, state, final=True))
        return taken

    def _wanted_in_prompt(self, request: Request, chunk: ChunkPlan) -> bool:
        end = chunk.end
        if chunk.is_decode or end > len(request.prompt_ids):
            return False
        on_grid = self.grid is not None and end % self.grid == 0 and end < len(request.prompt_ids)
        return (on_grid or end in request.checkpoint_marks) and self._first_time(request.request_id, end)

    def _wanted_in_output(self, request: Request, chunk: ChunkPlan) -> bool:
        outputs_consumed = chunk.end - len(request.prompt_ids)
        if self.decode_interval is None or outputs_consumed < 0 or outputs_consumed % self.decode_interval:
            return False
        if outputs_consumed == 0 and len(request.prompt_ids) < self.decode_interval:
            return False  # a short prompt is prefilled again in one step: cheaper than storing its state
        return self._first_time(request.request_id, chunk.end)

    def _first_time(self, request_id: str, end: int) -> bool:
        done = self._taken.setdefault(request_id, set())
        if end in done:
            return False
        done.add(end)
        return True
