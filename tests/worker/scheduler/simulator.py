"""Plays step plans on integer states, without torch: the scheduler's own test double of a model.

Each slot's content is the tuple of tokens its state consumed; a chunk that does not start where the
content ends (or at 0) makes it ``None``, corrupted for good, and every token sampled from a
corrupted content is ``GARBAGE``. The next token is a hash of the content and the choice, so a state
that holds the wrong tokens changes the output too.
"""

from __future__ import annotations

from collections.abc import Sequence

from metrale.worker.scheduler.plan import StepPlan
from metrale.worker.scheduler.sequence import SequenceId, StopParams

VOCAB = 31
GARBAGE = VOCAB
"""Never produced by a clean content."""

Content = tuple[int, ...] | None


def state_nbytes(length: int) -> int:
    return 16 * length + 8


def next_token(content: Content, choice: int) -> int:
    return GARBAGE if content is None else hash((content, choice)) % VOCAB


class StateSimulator:
    """Applies plans in the runner's order: swap-outs, swap-ins, chunks, forks, samples."""

    def __init__(self) -> None:
        self.slots: dict[int, Content] = {}
        self.host: dict[SequenceId, Content] = {}

    def run(self, plan: StepPlan) -> list[int]:
        for swap_out in plan.swap_outs:
            self.host[swap_out.seq_id] = _at_length(self.slots.pop(swap_out.slot, None), swap_out.length)
        for swap_in in plan.swap_ins:
            self.slots[swap_in.slot] = _at_length(self.host.pop(swap_in.seq_id), swap_in.length)
        rows: list[Content] = []
        for chunk in plan.chunks:
            content = () if chunk.start == 0 else _at_length(self.slots.get(chunk.slot), chunk.start)
            self.slots[chunk.slot] = None if content is None else (*content, *chunk.token_ids)
            rows.append(self.slots[chunk.slot])
        for fork in plan.forks:
            copy = _at_length(self.slots.get(fork.slot), fork.length)
            if fork.child_slot is None:
                self.host[fork.child] = copy
            else:
                self.slots[fork.child_slot] = copy
        return [next_token(rows[spec.row], spec.seq_id.choice) for spec in plan.samples]


def _at_length(content: Content, length: int) -> Content:
    return content if content is not None and len(content) == length else None


def isolated_tokens(prompt: Sequence[int], choice: int, stop: StopParams, max_model_len: int) -> list[int]:
    """What one choice produces when it runs alone, straight through."""
    content, output = tuple(prompt), []
    while True:
        token = next_token(content, choice)
        if token in stop.stop_token_ids:
            return [*output, token] if stop.include_stop_token else output
        output.append(token)
        content = (*content, token)
        if len(output) >= stop.max_tokens or len(content) > max_model_len:
            return output
