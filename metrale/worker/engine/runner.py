"""Carries out a StepPlan on the model: moves states, runs the forward, samples.

Every state move and every fed row is first recorded in the ``StateLedger``, which refuses any that
would break a recurrent state; the model is only called once the ledger agrees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import llguidance
import torch

from metrale.worker.engine.constraints import (
    PARALLEL_MASKS_FROM_VOCAB,
    ChoiceConstraint,
    CompiledGrammar,
    allowed_tokens,
)
from metrale.worker.engine.sampler import SampledToken, SamplingRow
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.state_ledger import FedChunk, StateLedger
from metrale.worker.model.interface import ForwardChunk, SequenceState, StatefulModel
from metrale.worker.scheduler.plan import ChunkPlan, Fork, SampleSpec, StepPlan, SwapIn, SwapOut
from metrale.worker.scheduler.sequence import SequenceId


class TokenSampler(Protocol):
    """What the runner needs of ``metrale.worker.engine.sampler.Sampler``."""

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], allowed: torch.Tensor | None = None
    ) -> list[SampledToken]: ...


@dataclass(frozen=True, slots=True)
class _SamplingSetup:
    params: SamplingParams
    seed: int
    grammar: CompiledGrammar | None = None
    stop_token_ids: frozenset[int] = frozenset()


class ModelRunner:
    """Owns the host copies of swapped-out states (keyed by sequence, never by slot), and the
    grammar constraints of the constrained choices that run (see ``constraints``): a choice's
    matcher is dropped with its state when it is swapped out, and rebuilt by replaying its output
    when it next samples."""

    def __init__(self, model: StatefulModel, sampler: TokenSampler, ledger: StateLedger) -> None:
        self.model = model
        self.sampler = sampler
        self.ledger = ledger
        self._parked: dict[SequenceId, SequenceState] = {}
        self._sampling: dict[str, _SamplingSetup] = {}
        self._constraints: dict[SequenceId, ChoiceConstraint] = {}
        self._grammar_executor: llguidance.LLExecutor | None = None

    def register(
        self,
        request_id: str,
        params: SamplingParams,
        seed: int,
        grammar: CompiledGrammar | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        """Remember how to sample for a request; ``seed`` is fixed for its whole life. With a
        ``grammar``, every choice samples only what it allows, ending on one of ``stop_token_ids``."""
        self._sampling[request_id] = _SamplingSetup(params, seed, grammar, stop_token_ids)

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request: its sampling setup, constraints and parked states."""
        self._sampling.pop(request_id, None)
        for seq_id in [seq_id for seq_id in self._parked if seq_id.request_id == request_id]:
            del self._parked[seq_id]
        for seq_id in [seq_id for seq_id in self._constraints if seq_id.request_id == request_id]:
            del self._constraints[seq_id]
        self.ledger.forget(request_id)

    def park(self, seq_id: SequenceId, state: SequenceState, length: int) -> None:
        """Hold a checkpointed state (after ``length`` tokens) until the scheduler swaps it in."""
        self.ledger.resume(seq_id, length)
        self._parked[seq_id] = state

    def export(self, slot: int, block_ids: Sequence[int], length: int) -> SequenceState:
        """A copy of the state in ``slot``/``block_ids`` after ``length`` tokens (for a checkpoint)."""
        return self.model.export_state(slot, block_ids, length)

    def parked_state(self, seq_id: SequenceId) -> SequenceState | None:
        """The host copy of a swapped-out (or not yet resumed) sequence's state, if it has one."""
        return self._parked.get(seq_id)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def run(self, plan: StepPlan) -> list[SampledToken]:
        """Execute ``plan``: swap-outs, swap-ins, forward, forks, then one token per sample spec."""
        for swap_out in plan.swap_outs:
            self._swap_out(swap_out)
        for swap_in in plan.swap_ins:
            self._swap_in(swap_in)
        logits = self._forward(plan.chunks)
        self._fork(plan.forks)
        return self._sample(logits, plan.samples)

    def _swap_out(self, swap: SwapOut) -> None:
        self.ledger.swap_out(swap.seq_id, swap.slot, swap.length)
        self._parked[swap.seq_id] = self.model.export_state(swap.slot, swap.block_ids, swap.length)
        self._constraints.pop(swap.seq_id, None)

    def _swap_in(self, swap: SwapIn) -> None:
        self.ledger.swap_in(swap.seq_id, swap.slot, swap.length)
        self.model.import_state(self._parked.pop(swap.seq_id), swap.slot, swap.block_ids)

    def _forward(self, chunks: Sequence[ChunkPlan]) -> torch.Tensor | None:
        """Logits ``[len(chunks), vocab]`` of each chunk's last token, or None without chunks."""
        if not chunks:
            return None
        self.ledger.feed(FedChunk(c.seq_id, c.slot, c.start, len(c.token_ids)) for c in chunks)
        return self.model.forward([ForwardChunk(c.slot, c.block_ids, c.start, c.token_ids) for c in chunks])

    def _fork(self, forks: Sequence[Fork]) -> None:
        exported: dict[tuple[SequenceId, int], SequenceState] = {}
        for fork in forks:
            self.ledger.fork(fork.parent, fork.slot, fork.length, fork.child, fork.child_slot)
            key = (fork.parent, fork.length)
            if key not in exported:
                exported[key] = self.model.export_state(fork.slot, fork.block_ids, fork.length)
            if fork.child_slot is None:
                self._parked[fork.child] = exported[key]
            else:
                self.model.import_state(exported[key], fork.child_slot, fork.child_block_ids)

    def _sample(self, logits: torch.Tensor | None, samples: Sequence[SampleSpec]) -> list[SampledToken]:
        if not samples:
            return []
        assert logits is not None, "sample specs without a forward"
        rows = [self._sampling_row(spec) for spec in samples]
        index = torch.tensor([spec.row for spec in samples], device=logits.device)
        selected = logits.index_select(0, index)
        allowed = self._allowed_tokens(samples, selected.shape[1])
        if allowed is None:
            return self.sampler.sample(selected, rows)
        return self.sampler.sample(selected, rows, allowed)

    def _allowed_tokens(self, samples: Sequence[SampleSpec], vocab_size: int) -> torch.Tensor | None:
        """Bool ``[len(samples), vocab_size]``: what each row's grammar allows next (every token for
        a free row); None when no row is constrained."""
        constrained: list[int] = []
        constraints: list[ChoiceConstraint] = []
        for i, spec in enumerate(samples):
            setup = self._sampling[spec.seq_id.request_id]
            if setup.grammar is None:
                continue
            constraint = self._constraints.get(spec.seq_id)
            if constraint is None:
                constraint = ChoiceConstraint(setup.grammar, setup.stop_token_ids)
                self._constraints[spec.seq_id] = constraint
            constraint.follow(spec.output_ids)
            constrained.append(i)
            constraints.append(constraint)
        if not constraints:
            return None
        masks = allowed_tokens(constraints, self._mask_executor(vocab_size))
        if masks.shape[1] != vocab_size:
            raise ValueError(f"the grammar's vocabulary has {masks.shape[1]} ids, the logits {vocab_size}")
        allowed = torch.ones(len(samples), vocab_size, dtype=torch.bool)
        allowed[constrained] = masks
        return allowed

    def _mask_executor(self, vocab_size: int) -> llguidance.LLExecutor | None:
        """llguidance's threads for the masks of a large vocabulary; None: this thread computes them."""
        if vocab_size < PARALLEL_MASKS_FROM_VOCAB:
            return None
        if self._grammar_executor is None:
            self._grammar_executor = llguidance.LLExecutor()
        return self._grammar_executor

    def dead_end(self, seq_id: SequenceId) -> str | None:
        """Why the choice's grammar allowed no token at its last sample (None: it allowed one, or the
        choice is free)."""
        constraint = self._constraints.get(seq_id)
        return None if constraint is None else constraint.dead_end

    def constraint(self, seq_id: SequenceId) -> ChoiceConstraint | None:
        """The live grammar constraint of a constrained choice (None before it samples)."""
        return self._constraints.get(seq_id)

    def _sampling_row(self, spec: SampleSpec) -> SamplingRow:
        setup = self._sampling[spec.seq_id.request_id]
        return SamplingRow(
            setup.params, setup.seed, spec.seq_id.choice, spec.position, spec.prompt_ids, spec.output_ids
        )
