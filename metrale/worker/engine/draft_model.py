"""A draft model (vLLM's ``draft_model`` speculative method): a model over the target's tokenizer — any
family Metrale serves, itself recurrent — drafts its greedy continuation of each decoding choice.

The draft model keeps its own state per choice, in its own pools, by the target's rules: a slot's
recurrent state never consumes a position twice and is never rewound. A choice's **committed slot** holds
the state after the tokens the choice has settled on (its prompt and outputs: ``_DraftSequence.tokens``);
drafting the tokens after the first runs in a **scratch slot**, a copy of it, so draft tokens the target
then rejects never reach the committed state. The next step feeds the committed slot what the target
accepted (draft tokens and the token it drew itself) as one chunk. The scratch slot's attention entries
past the choice's context lie where that feed writes them again before anything reads them.

Outputs never depend on the draft (``speculation``): whatever this proposes, the target's tokens are those
of plain decoding. So a slot may be taken back from a choice at any time (the least recently drafted goes
first when slots or blocks run out); the choice starts over from its first token when it drafts again.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from metrale.text.tokenizer import Tokenizer
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from metrale.worker.model.precision import DtypeChoice
from metrale.worker.scheduler.sequence import SequenceId

CHUNK_TOKENS = 2048
"""The most tokens the draft model is fed in one forward (a long prompt's catch-up runs in chunks)."""

CHECKED_TAIL = 64
"""A choice's context only grows, so a kept state is checked against the new context's last this many of
the tokens it consumed (a state that does not match starts over; a miss would cost drafts, not answers)."""


@dataclass
class _DraftSequence:
    """A choice's committed slot: the state after ``tokens`` (a prefix of its context), over ``blocks``;
    ``next_token`` is the draft model's greedy token after them."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    next_token: int = -1


class DraftModelDrafter:
    """Drafts with ``executor``'s model: its greedy tokens, at most ``num_speculative_tokens`` a step.

    ``executor`` is the draft model's own (its slots and blocks are this drafter's alone): its last slot is
    the scratch slot, the others are lent to choices (``relative_step_cost`` times it before any is).
    ``vocab_size``: the target's; a draft id at or past it is never proposed. ``max_len``: the longest
    context drafted for (the draft model's own limit).
    """

    def __init__(self, executor: ModelExecutor, num_speculative_tokens: int, vocab_size: int, max_len: int) -> None:
        if executor.num_slots < 2:
            raise ValueError("a draft model needs two slots at least: a choice's and the scratch slot")
        self.num_speculative_tokens = num_speculative_tokens
        self.executor = executor
        self._vocab_size = min(vocab_size, executor.vocab_size)
        self._max_len = max_len
        self._scratch = executor.num_slots - 1
        self._free_slots = list(range(self._scratch))
        self._free_blocks = list(range(executor.num_blocks - 1, -1, -1))
        self._sequences: OrderedDict[SequenceId, _DraftSequence] = OrderedDict()
        """Least recently drafted first."""

    def propose(
        self, seq_id: SequenceId, prompt_ids: Sequence[int], output_ids: Sequence[int], at_most: int
    ) -> Sequence[int]:
        """The draft model's greedy continuation of ``prompt_ids`` + ``output_ids``: ``min(at_most,
        num_speculative_tokens)`` tokens, or none when its pools cannot hold the choice."""
        count = min(self.num_speculative_tokens, at_most)
        context = [*prompt_ids, *output_ids]
        if count < 1 or not context or len(context) + count - 1 > self._max_len:
            return ()
        sequence = self._sequence(seq_id, len(context) + count - 1)
        if sequence is None:
            return ()
        drafts = [self._catch_up(sequence, context)]
        if count > 1:
            self.executor.copy_slot(sequence.slot, self._scratch)
            for position in range(len(context), len(context) + count - 1):
                chunk = ForwardChunk(self._scratch, sequence.blocks, position, (drafts[-1],))
                drafts.append(self._greedy(self.executor.forward([chunk])[-1]))
        return tuple(drafts)

    def forget(self, request_id: str) -> None:
        """Give back the slots and blocks of every choice of ``request_id``."""
        for seq_id in [seq_id for seq_id in self._sequences if seq_id.request_id == request_id]:
            self._drop(seq_id)

    def _catch_up(self, sequence: _DraftSequence, context: list[int]) -> int:
        """Feed the committed slot the context's tokens it has not consumed; the greedy token after them."""
        known = len(sequence.tokens)
        tail = max(0, known - CHECKED_TAIL)
        if known > len(context) or sequence.tokens[tail:] != context[tail:known]:
            sequence.tokens, known = [], 0
        if known == len(context):
            return sequence.next_token
        logits = torch.empty(0)
        for start in range(known, len(context), CHUNK_TOKENS):
            piece = tuple(context[start : start + CHUNK_TOKENS])
            logits = self.executor.forward([ForwardChunk(sequence.slot, sequence.blocks, start, piece)])
        sequence.tokens = context
        sequence.next_token = self._greedy(logits[-1])
        return sequence.next_token

    def _greedy(self, logits: torch.Tensor) -> int:
        return int(logits[: self._vocab_size].argmax())

    def _sequence(self, seq_id: SequenceId, length: int) -> _DraftSequence | None:
        """``seq_id``'s committed slot with blocks for ``length`` positions, taking back the least recently
        drafted choices' slots and blocks where needed; None when even all of them are too few."""
        sequence = self._sequences.pop(seq_id, None)
        if sequence is None:
            if not self._free_slots and not self._evict_one():
                return None
            sequence = _DraftSequence(self._free_slots.pop())
        self._sequences[seq_id] = sequence  # the most recently drafted, so the last to be taken back
        needed = -(-length // self.executor.block_size) - len(sequence.blocks)
        while len(self._free_blocks) < needed:
            if not self._evict_one(keep=seq_id):
                self._drop(seq_id)
                return None
        sequence.blocks += [self._free_blocks.pop() for _ in range(max(needed, 0))]
        return sequence

    def _evict_one(self, keep: SequenceId | None = None) -> bool:
        """Take back the least recently drafted choice's slot and blocks (never ``keep``'s); False: none left."""
        victim = next((seq_id for seq_id in self._sequences if seq_id != keep), None)
        if victim is None:
            return False
        self._drop(victim)
        return True

    def _drop(self, seq_id: SequenceId) -> None:
        sequence = self._sequences.pop(seq_id)
        self._free_slots.append(sequence.slot)
        self._free_blocks += sequence.blocks


def relative_step_cost(draft: ModelExecutor, target: ModelExecutor, steps: int = 5) -> float:
    """What one draft token costs in lone decode steps of the target (``StepCost``'s unit): the median
    time of a one-row decode forward of ``draft`` over one of ``target``, each after a short prompt in its
    first slot, before either serves anything (a fresh sequence's first chunk starts at position 0, so
    nothing of this is ever read). On a CPU a small model's step is mostly its fixed cost, so its size
    alone would undersell it."""

    def step_seconds(executor: ModelExecutor) -> float:
        blocks = [0, 1]
        executor.forward([ForwardChunk(0, blocks, 0, tuple(range(1, 9)))])
        times = []
        for position in range(8, 10 + steps):
            start = time.perf_counter()
            executor.forward([ForwardChunk(0, blocks, position, (1,))])
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])

    return step_seconds(draft) / step_seconds(target)


class DraftTokenizerError(ValueError):
    """The draft model's tokenizer is not the target's: its drafts would be other tokens' ids."""


def load_drafter(
    directory: str | Path,
    *,
    num_speculative_tokens: int,
    target_tokenizer: Tokenizer,
    target_vocab_size: int,
    max_seqs: int,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    device: str = "cpu",
    dtype: DtypeChoice = None,
) -> DraftModelDrafter:
    """Load the draft model in ``directory`` with pools for ``max_seqs`` choices (plus the scratch slot) and
    ``num_blocks`` blocks (plus a block per choice for its draft positions), as the target's engine is sized.

    Raises:
        DraftTokenizerError: the draft model's tokenizer maps some token to another id than the target's.
    """
    directory = Path(directory)
    _check_same_tokenizer(Tokenizer.from_dir(directory), target_tokenizer, directory)
    model = load_model(directory, dtype=dtype, device=device)
    executor = ModelExecutor(model, num_slots=max_seqs + 1, num_blocks=num_blocks + max_seqs, block_size=block_size)
    max_len = min(max_model_len, int(model.config.max_position_embeddings))
    return DraftModelDrafter(executor, num_speculative_tokens, target_vocab_size, max_len)


def _check_same_tokenizer(draft: Tokenizer, target: Tokenizer, directory: Path) -> None:
    draft_vocab, target_vocab = draft.vocabulary(), target.vocabulary()
    if draft_vocab == target_vocab:
        return
    differing = sorted(
        token for token in draft_vocab.keys() | target_vocab.keys() if draft_vocab.get(token) != target_vocab.get(token)
    )
    token = differing[0]
    raise DraftTokenizerError(
        f"the draft model {directory} has another tokenizer than the target's: {len(differing)} tokens differ, "
        f"e.g. {token!r} is {draft_vocab.get(token)} there and {target_vocab.get(token)} in the target"
    )
