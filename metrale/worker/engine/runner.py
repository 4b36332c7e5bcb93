"""Carries out a StepPlan on the model: moves states, runs the forward, samples.

Every state move and every fed row is first recorded in the ``StateLedger``, which refuses any that
would break a recurrent state; the model is only called once the ledger agrees. A prefill chunk of a
request that wants its prompt logprobs asks the model for every row's logits, scored right after the
forward (``prompt_logprobs.py``): the same forward that fills the state, never a second one.

A verify chunk (speculative decoding, ``ChunkPlan.num_draft``) samples every one of its rows, each as
plain decoding would sample it had the draft tokens before it been accepted (same seed, choice and
position, the penalties over the output so far and those draft tokens); the draft is accepted up to its
first token that differs from what the target drew there, which is replaced by the drawn one
(``accept_draft``). ``settle`` then tells the ledger and the model how many rows the state keeps.
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
from metrale.worker.engine.prompt_logprobs import PromptLogprobs, PromptScorer
from metrale.worker.engine.sampler import SampledToken, SamplingRow
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.state_ledger import FedChunk, StateLedger
from metrale.worker.model.interface import ForwardChunk, SequenceState, StatefulModel, logit_row_counts
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
        self._prompt_scorer = PromptScorer()
        self._prompt_logprobs: list[tuple[str, PromptLogprobs]] = []

    def register(
        self,
        request_id: str,
        params: SamplingParams,
        seed: int,
        grammar: CompiledGrammar | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        prompt_ids: Sequence[int] = (),
    ) -> None:
        """Remember how to sample for a request; ``seed`` is fixed for its whole life. With a
        ``grammar``, every choice samples only what it allows, ending on one of ``stop_token_ids``.
        With ``params.prompt_logprobs``, its prefill scores ``prompt_ids`` (``take_prompt_logprobs``)."""
        self._sampling[request_id] = _SamplingSetup(params, seed, grammar, stop_token_ids)
        if params.prompt_logprobs is not None:
            self._prompt_scorer.register(request_id, prompt_ids, params.prompt_logprobs)

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request: its sampling setup, constraints and parked states."""
        self._sampling.pop(request_id, None)
        self._prompt_scorer.forget(request_id)
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
        """Execute ``plan`` (no verify chunks): swap-outs, swap-ins, forward, forks, then one token per
        sample spec."""
        if any(spec.draft for spec in plan.samples):
            raise ValueError("a plan with verify chunks runs through run_accepting")
        return [tokens[0] for tokens in self.run_accepting(plan)]

    def run_accepting(self, plan: StepPlan) -> list[list[SampledToken]]:
        """Execute ``plan``: swap-outs, swap-ins, forward, forks, then per sample spec its tokens: one,
        or for a verify chunk the accepted draft tokens and the one drawn after them. Every verify
        chunk's slot is left unsettled: ``settle`` it once the scheduler has appended the tokens."""
        for swap_out in plan.swap_outs:
            self._swap_out(swap_out)
        for swap_in in plan.swap_ins:
            self._swap_in(swap_in)
        logits = self._forward(plan.chunks)
        self._fork(plan.forks)
        return self._sample(logits, plan.samples)

    def settle(self, chunk: ChunkPlan, rows: int) -> None:
        """Keep the state after the first ``rows`` tokens of verify ``chunk`` (the rest are dropped)."""
        self.ledger.settle(chunk.seq_id, chunk.slot, rows)
        self.model.settle_verified(chunk.slot, rows)

    def _swap_out(self, swap: SwapOut) -> None:
        self.ledger.swap_out(swap.seq_id, swap.slot, swap.length)
        self._parked[swap.seq_id] = self.model.export_state(swap.slot, swap.block_ids, swap.length)
        self._constraints.pop(swap.seq_id, None)

    def _swap_in(self, swap: SwapIn) -> None:
        self.ledger.swap_in(swap.seq_id, swap.slot, swap.length)
        self.model.import_state(self._parked.pop(swap.seq_id), swap.slot, swap.block_ids)

    def take_prompt_logprobs(self) -> list[tuple[str, PromptLogprobs]]:
        """The prompt logprobs scored by the forwards since the last call, by request, in order."""
        taken, self._prompt_logprobs = self._prompt_logprobs, []
        return taken

    def _forward(self, chunks: Sequence[ChunkPlan]) -> torch.Tensor | None:
        """Logits of each chunk's last token — and, before it, of every row of a verify chunk — chunk
        by chunk (``[len(chunks) + drafts, vocab]``), or None without chunks; the prompt logprobs the
        chunks score are kept for ``take_prompt_logprobs``."""
        if not chunks:
            return None
        self.ledger.feed(FedChunk(c.seq_id, c.slot, c.start, len(c.token_ids), c.num_draft > 0) for c in chunks)
        forward = [
            ForwardChunk(
                c.slot, c.block_ids, c.start, c.token_ids, every_row=self._scores_prompt(c), verify=c.num_draft > 0
            )
            for c in chunks
        ]
        logits = self.model.forward(forward)
        if not any(chunk.every_row for chunk in forward):
            return logits
        ends = torch.tensor(logit_row_counts(forward)).cumsum(0)
        for chunk, forwarded, end in zip(chunks, forward, ends.tolist(), strict=True):
            if forwarded.every_row:
                self._score_prompt(chunk, logits[end - len(chunk.token_ids) : end])
        kept = [
            row
            for chunk, end in zip(chunks, ends.tolist(), strict=True)
            for row in range(end - 1 - chunk.num_draft, end)
        ]
        return logits.index_select(0, torch.tensor(kept, device=logits.device))

    def _scores_prompt(self, chunk: ChunkPlan) -> bool:
        return not chunk.is_decode and self._prompt_scorer.wants_rows(chunk.seq_id.request_id, chunk.start, chunk.end)

    def _score_prompt(self, chunk: ChunkPlan, logits: torch.Tensor) -> None:
        request_id = chunk.seq_id.request_id
        scored = self._prompt_scorer.score(request_id, chunk.start, logits)
        if scored is not None:
            self._prompt_logprobs.append((request_id, scored))

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

    def _sample(self, logits: torch.Tensor | None, samples: Sequence[SampleSpec]) -> list[list[SampledToken]]:
        if not samples:
            return []
        assert logits is not None, "sample specs without a forward"
        first_rows = _first_logit_rows(samples, logits.shape[0])
        rows = [row for spec in samples for row in self._sampling_rows(spec)]
        index = torch.tensor(
            [first_rows[spec.row] + r for spec in samples for r in range(len(spec.draft) + 1)], device=logits.device
        )
        selected = logits.index_select(0, index)
        allowed = self._allowed_tokens(samples, selected.shape[1])
        if allowed is not None and len(rows) > len(samples):  # a draft's rows are free: constrained specs have none
            allowed = allowed.repeat_interleave(torch.tensor([len(spec.draft) + 1 for spec in samples]), dim=0)
        drawn = self.sampler.sample(selected, rows) if allowed is None else self.sampler.sample(selected, rows, allowed)
        accepted, at = [], 0
        for spec in samples:
            accepted.append(accept_draft(spec.draft, drawn[at : at + len(spec.draft) + 1]))
            at += len(spec.draft) + 1
        return accepted

    def _allowed_tokens(self, samples: Sequence[SampleSpec], vocab_size: int) -> torch.Tensor | None:
        """Bool ``[len(samples), vocab_size]``: what each row's grammar allows next (every token for
        a free row); None when no row is constrained."""
        constrained: list[int] = []
        constraints: list[ChoiceConstraint] = []
        for i, spec in enumerate(samples):
            setup = self._sampling[spec.seq_id.request_id]
            if setup.grammar is None:
                continue
            if spec.draft:
                raise ValueError(
                    f"{spec.seq_id} is constrained: its grammar is followed token by token, without drafts"
                )
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

    def _sampling_rows(self, spec: SampleSpec) -> list[SamplingRow]:
        """The spec's row, then one per draft token: the row after ``r`` draft tokens samples position
        ``position + r`` with those tokens as the latest output, as plain decoding would have."""
        setup = self._sampling[spec.seq_id.request_id]
        choice = spec.seq_id.choice
        rows = [SamplingRow(setup.params, setup.seed, choice, spec.position, spec.prompt_ids, spec.output_ids)]
        for r in range(1, len(spec.draft) + 1):
            output = (*spec.output_ids, *spec.draft[:r])
            rows.append(SamplingRow(setup.params, setup.seed, choice, spec.position + r, spec.prompt_ids, output))
        return rows

    def wants_drafts(self, seq_id: SequenceId) -> bool:
        """Whether a choice may verify drafts: an unconstrained one (a grammar is followed token by token)
        of a request that did not turn speculation off (``SamplingParams.speculative``)."""
        setup = self._sampling.get(seq_id.request_id)
        return setup is not None and setup.grammar is None and setup.params.speculative


def accept_draft(draft: Sequence[int], drawn: Sequence[SampledToken]) -> list[SampledToken]:
    """The tokens a verify chunk emits: ``drawn[r]`` is what the target drew after ``r`` draft tokens.
    Draft token ``r`` is accepted exactly when it equals ``drawn[r]``; the first that differs is
    replaced by ``drawn[r]``, which ends the list (so it has at least one token, at most
    ``len(draft) + 1``). Every token is then the very one plain decoding draws at its position."""
    accepted = 0
    while accepted < len(draft) and drawn[accepted].token_id == draft[accepted]:
        accepted += 1
    return list(drawn[: accepted + 1])


def _first_logit_rows(samples: Sequence[SampleSpec], num_rows: int) -> dict[int, int]:
    """Per chunk row number that samples, the first row of its logits (``_forward`` gives a verify
    chunk ``len(draft) + 1`` rows, any other chunk one)."""
    width = {spec.row: len(spec.draft) + 1 for spec in samples}
    first, at = {}, 0
    for row in range(max(width) + 1):
        first[row] = at
        at += width.get(row, 1)
    assert at <= num_rows, "fewer logit rows than the plan samples"
    return first
