"""Continuous batching for sequences whose state cannot be rewound.

Each step: running sequences keep (or grow) their KV blocks, preempting the lowest-ranked ones when
blocks run out, and batch sequences make room for an interactive one that waits; decode rows come
first (a batch sequence's sit out a step that prefills an interactive prompt), then swapped-out
sequences come back, then prefill chunks of running sequences, then new sequences are admitted, all
within the token budget.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from metrale.worker.scheduler.allocator import Allocator
from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.plan import (
    ChunkPlan,
    FinalState,
    Fork,
    HeldState,
    SampleSpec,
    SequenceUpdate,
    StepPlan,
    SwapIn,
    SwapOut,
)
from metrale.worker.scheduler.sequence import (
    FinishReason,
    Priority,
    Sequence,
    SequenceId,
    SequenceStatus,
    StopParams,
)
from metrale.worker.scheduler.swap import SwapSpace


@dataclass(slots=True)
class _Budget:
    """Tokens left to plan in the current step."""

    tokens: int


class DraftSource(Protocol):
    """Speculative decoding's drafts, asked once per step for the step's decoding sequences."""

    def lengths(self, caps: Seq[tuple[SequenceId, int]], other_rows: int) -> Seq[int]:
        """Per decoding sequence of the step (``caps``: each with the most draft tokens it may verify, in
        row order), how many draft tokens to ask it for; ``other_rows`` counts the step's prefill rows."""
        ...

    def propose(self, seq_id: SequenceId, prompt_ids: Seq[int], output_ids: Seq[int], at_most: int) -> Seq[int]:
        """Up to ``at_most`` draft tokens to verify after the newest sampled token; empty: decode plainly."""
        ...


class PromptTooLongError(ValueError):
    """The prompt does not fit ``max_model_len``."""


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Queue lengths and free resources; ``swap_outs`` and ``restarts`` count preemptions so far."""

    running: int
    waiting: int
    swapped: int
    free_slots: int
    free_blocks: int
    swap_bytes_used: int
    swap_outs: int
    restarts: int
    running_batch: int = 0
    waiting_interactive: int = 0


class Scheduler:
    """Plans steps over plain integers; ``state_nbytes(length)`` sizes a swapped-out state."""

    def __init__(self, config: SchedulerConfig, state_nbytes: Callable[[int], int]) -> None:
        self.config = config
        self._state_nbytes = state_nbytes
        self._allocator = Allocator(config.num_slots, config.num_blocks, config.block_size, config.watermark)
        self._swap = SwapSpace(config.swap_space_bytes)
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._swapped: list[Sequence] = []
        self._live: dict[SequenceId, Sequence] = {}
        self._choices: dict[str, list[SequenceId]] = {}
        self._arrivals = itertools.count()
        self._swap_outs = 0
        self._restarts = 0

    def add(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        stop: StopParams,
        priority: Priority,
        n: int = 1,
        *,
        resume_length: int = 0,
        marks: Seq[int] = (),
        generated: Seq[int] = (),
    ) -> None:
        """Queue a request of ``n`` choices. Raises ``PromptTooLongError`` or ``ValueError``.

        ``resume_length > 0``: the caller holds the exact state after the first ``resume_length``
        tokens of prompt + ``generated`` (a checkpoint, handed to the runner); the sequence waits among
        the swapped ones and its prefill continues from there. ``marks``: positions a prefill chunk must
        end at. ``generated``: output tokens choice 0 already produced elsewhere (a request moved from
        another worker, ``n == 1`` only); they are fed one per step (``Sequence.replay_outputs``), count
        towards ``max_tokens``, and sampling continues after them.
        """
        known = len(prompt_ids) + len(generated)
        self._check_new(request_id, prompt_ids, stop, n, generated)
        if known > self.config.max_model_len:
            raise PromptTooLongError(f"the prompt has {known:,} tokens; the limit is {self.config.context_limit()}")
        if not 0 <= resume_length < known:
            raise ValueError(f"resume_length {resume_length} must leave at least one known token to feed")
        seq = Sequence(SequenceId(request_id, 0), list(prompt_ids), stop, priority, next(self._arrivals))
        seq.output_ids = list(generated)
        seq.replay_outputs = bool(generated)
        seq.pending_forks = n - 1
        seq.marks = tuple(sorted(m for m in set(marks) if resume_length < m < len(prompt_ids)))
        self._choices[request_id] = [seq.seq_id]
        self._live[seq.seq_id] = seq
        if resume_length:
            seq.num_computed = resume_length
            self._enqueue(self._swapped, seq, SequenceStatus.SWAPPED)
        else:
            self._enqueue(self._waiting, seq, SequenceStatus.WAITING)

    def _check_new(self, request_id: str, prompt_ids: Seq[int], stop: StopParams, n: int, generated: Seq[int]) -> None:
        if request_id in self._choices:
            raise ValueError(f"request {request_id!r} is already scheduled")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if generated and n > 1:
            raise ValueError("only a request with n == 1 can continue from already generated tokens")
        if len(generated) >= stop.max_tokens:
            raise ValueError(f"{len(generated)} tokens already generated; max_tokens is {stop.max_tokens}")

    def tokens(self, seq_id: SequenceId, end: int) -> tuple[int, ...] | None:
        """The first ``end`` tokens (prompt, then output) of a live sequence; None once it has ended."""
        seq = self._live.get(seq_id)
        return seq.tokens_between(0, end) if seq is not None else None

    def held_state(self, request_id: str) -> HeldState | None:
        """Where choice 0 of a request keeps its state now, and the tokens that state consumed.

        None when it holds no state (waiting to start, or not live). Call between steps only.
        """
        seq = self._live.get(SequenceId(request_id, 0))
        if seq is None or seq.num_computed == 0 or seq.status is SequenceStatus.WAITING:
            return None
        running = seq.status is SequenceStatus.RUNNING
        blocks = self._blocks_covering(seq, seq.num_computed) if running else ()
        consumed = seq.tokens_between(0, seq.num_computed)
        return HeldState(seq.seq_id, seq.slot if running else None, blocks, consumed)

    def abort(self, request_id: str) -> list[SequenceId]:
        """Drop every choice of the request and free what they hold; return the dropped ids."""
        seq_ids = self._choices.pop(request_id, [])
        for seq_id in seq_ids:
            seq = self._live.get(seq_id)
            if seq is not None:
                self._finish(seq, FinishReason.ABORT)
        return seq_ids

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def is_finished(self, request_id: str) -> bool:
        """Whether every choice of the request finished (or it was never added)."""
        return request_id not in self._choices

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting),
            swapped=len(self._swapped),
            free_slots=self._allocator.free_slots,
            free_blocks=self._allocator.free_blocks,
            swap_bytes_used=self._swap.used_bytes,
            swap_outs=self._swap_outs,
            restarts=self._restarts,
            running_batch=sum(1 for seq in self._running if seq.priority is Priority.BATCH),
            waiting_interactive=sum(1 for seq in self._waiting if seq.priority is Priority.INTERACTIVE),
        )

    def schedule(self, drafts: DraftSource | None = None) -> StepPlan:
        """Plan the next step. Every running sequence that is decoding gets its row.

        ``drafts`` (speculative decoding) proposes draft tokens for decoding sequences; a decode row
        becomes a verify chunk of the newest token and the draft, within the token budget the rest of
        the step leaves, the blocks free above the watermark, ``max_model_len`` and the tokens the
        sequence may still emit. A step that preempts verifies no draft."""
        plan = StepPlan()
        budget = _Budget(self.config.max_batch_tokens)
        self._keep_running(plan)
        short_of_blocks = plan.preempted  # nothing new enters a step that had to preempt to go on
        self._make_room_for_interactive(plan)
        batch_waits = self._interactive_prompt_pending(short_of_blocks)
        decoding = [s for s in self._running if s.is_decoding and not (batch_waits and s.priority is Priority.BATCH)]
        for seq in decoding:
            self._add_chunk(seq, plan, budget)
        if not plan.preempted:
            self._swap_in(plan, budget)
        for seq in sorted(self._running, key=lambda s: s.rank):
            if not seq.is_decoding and budget.tokens:
                self._add_chunk(seq, plan, budget)
        if not short_of_blocks:  # the room made for an interactive sequence is taken at once (swap-outs run first)
            self._admit(plan, budget)
        if drafts is not None and not plan.preempted:  # speculation takes what the step leaves
            self._add_drafts(plan, budget, drafts)
        return plan

    def _keep_running(self, plan: StepPlan) -> None:
        """Grow every running sequence's blocks to its known tokens, preempting from the bottom."""
        queue = sorted(self._running, key=lambda s: s.rank)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            while not self._allocator.can_grow(seq, seq.num_tokens):
                victim = queue.pop() if queue else seq
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                self._allocator.grow(seq, seq.num_tokens)
                kept.append(seq)
        self._running = kept

    def _interactive_prompt_pending(self, short_of_blocks: bool) -> bool:
        """Whether this step prefills an interactive prompt (one running, or the first waiting one about
        to be admitted): batch decode rows then sit the step out, so the interactive request's first
        token takes one short step, not one as long as the whole batch's."""
        if any(s.priority is Priority.INTERACTIVE and s.num_computed < len(s.prompt_ids) for s in self._running):
            return True
        first = self._waiting[0] if self._waiting else None
        return (
            first is not None
            and first.priority is Priority.INTERACTIVE
            and not short_of_blocks
            and self._has_room_for(first)
        )

    def _make_room_for_interactive(self, plan: StepPlan) -> None:
        """While the first waiting sequence is interactive and finds no room, preempt the lowest-ranked
        running batch sequence (its exact state swapped out, or a restart without swap space): an
        interactive request never waits for batch work to finish. It is admitted in the same step, into
        the slot the swap-out (run before the forward) empties."""
        while self._waiting and self._waiting[0].priority is Priority.INTERACTIVE:
            if self._has_room_for(self._waiting[0]):
                return
            batch = [seq for seq in self._running if seq.priority is Priority.BATCH]
            if not batch:
                return
            victim = max(batch, key=lambda seq: seq.rank)
            self._running.remove(victim)
            self._preempt(victim, plan)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Swap ``seq``'s exact state out if host memory allows; otherwise drop it for a restart."""
        nbytes = self._state_nbytes(seq.num_computed)
        assert seq.slot is not None
        if self._swap.can_hold(nbytes):
            blocks = self._blocks_covering(seq, seq.num_computed)
            plan.swap_outs.append(SwapOut(seq.seq_id, seq.slot, blocks, seq.num_computed))
            self._swap.reserve(seq.seq_id, nbytes)
            self._allocator.free(seq)
            self._enqueue(self._swapped, seq, SequenceStatus.SWAPPED)
            self._swap_outs += 1
        else:
            plan.restarts.append(seq.seq_id)
            self._allocator.free(seq)
            seq.num_computed = 0
            self._enqueue(self._waiting, seq, SequenceStatus.WAITING)
            self._restarts += 1

    def _swap_in(self, plan: StepPlan, budget: _Budget) -> None:
        while self._swapped and self._has_room_for(self._swapped[0]) and not self._waiting_outranks_swapped():
            seq = self._swapped.pop(0)
            self._allocator.enter(seq, seq.num_tokens)
            assert seq.slot is not None
            blocks = self._blocks_covering(seq, seq.num_computed)
            plan.swap_ins.append(SwapIn(seq.seq_id, seq.slot, blocks, seq.num_computed))
            if seq.seq_id in self._swap:  # a resumed checkpoint holds no swap space
                self._swap.release(seq.seq_id)
            self._enter_running(seq)
            if seq.is_decoding:
                self._add_chunk(seq, plan, budget)

    def _admit(self, plan: StepPlan, budget: _Budget) -> None:
        while self._waiting and budget.tokens and self._has_room_for(self._waiting[0]):
            if self._swapped and not self._waiting_outranks_swapped():
                break  # swapped sequences return first, unless a waiting one has a higher priority
            seq = self._waiting.pop(0)
            self._allocator.enter(seq, seq.num_tokens)
            self._enter_running(seq)
            self._add_chunk(seq, plan, budget)

    def _waiting_outranks_swapped(self) -> bool:
        """Whether the first waiting sequence has a higher priority than the first swapped one: an
        interactive request never waits behind a batch sequence, swapped out or not."""
        return bool(self._waiting and self._swapped) and self._waiting[0].priority < self._swapped[0].priority

    def _has_room_for(self, seq: Sequence) -> bool:
        return len(self._running) < self.config.max_seqs and self._allocator.can_enter(seq.num_tokens)

    def _add_chunk(self, seq: Sequence, plan: StepPlan, budget: _Budget) -> None:
        """Plan ``seq``'s next chunk; when it reaches the end of the known tokens, sample (and fork)."""
        length = self._chunk_length(seq, budget.tokens)
        start, end = seq.num_computed, seq.num_computed + length
        assert seq.slot is not None and length > 0
        row = len(plan.chunks)
        plan.chunks.append(
            ChunkPlan(
                seq.seq_id,
                seq.slot,
                self._blocks_covering(seq, end),
                start,
                seq.tokens_between(start, end),
                seq.is_decoding,
            )
        )
        budget.tokens -= length
        if end == seq.num_tokens:
            plan.samples.append(SampleSpec(seq.seq_id, row, end, seq.prompt_ids, seq.output_ids))
            if seq.pending_forks:
                self._fork(seq, row, plan)

    def _add_drafts(self, plan: StepPlan, budget: _Budget, drafts: DraftSource) -> None:
        """Turn decode rows into verify chunks where ``drafts`` proposes tokens and room allows."""
        decoding = [(index, chunk) for index, chunk in enumerate(plan.chunks) if chunk.is_decode]
        if not decoding:
            return
        caps = [(chunk.seq_id, self._draft_cap(self._live[chunk.seq_id])) for _, chunk in decoding]
        other_rows = sum(len(chunk.token_ids) for chunk in plan.chunks if not chunk.is_decode)
        lengths = drafts.lengths(caps, other_rows)
        for (index, chunk), (_, cap), length in zip(decoding, caps, lengths, strict=True):
            at_most = min(budget.tokens, cap, length)
            if at_most < 1:
                continue
            seq = self._live[chunk.seq_id]
            draft = tuple(drafts.propose(seq.seq_id, seq.prompt_ids, seq.output_ids, at_most)[:at_most])
            draft = draft[: self._draft_room(seq, len(draft))]
            if not draft:
                continue
            budget.tokens -= len(draft)
            end = chunk.end + len(draft)
            plan.chunks[index] = ChunkPlan(
                seq.seq_id,
                chunk.slot,
                self._blocks_covering(seq, end),
                chunk.start,
                (*chunk.token_ids, *draft),
                True,
                num_draft=len(draft),
            )
            for at, spec in enumerate(plan.samples):
                if spec.row == index:
                    plan.samples[at] = SampleSpec(
                        spec.seq_id, spec.row, spec.position, spec.prompt_ids, spec.output_ids, draft
                    )

    def _draft_cap(self, seq: Sequence) -> int:
        """The most draft tokens ``seq`` may verify: the tokens it may still emit, less the last (the last
        token it may emit is never fed), within ``max_model_len``."""
        return max(0, min(seq.stop.max_tokens - len(seq.output_ids) - 1, self.config.max_model_len - seq.num_tokens))

    def _draft_room(self, seq: Sequence, wanted: int) -> int:
        """How many of ``wanted`` draft tokens ``seq``'s blocks hold, growing them only from the blocks
        free above the watermark (a draft never takes what a sequence entering would need)."""
        for count in range(wanted, 0, -1):
            needed = self._allocator.blocks_for(seq.num_tokens + count) - len(seq.block_ids)
            if needed <= 0:
                return count
            if self._allocator.free_blocks - needed >= self._allocator.watermark:
                self._allocator.grow(seq, seq.num_tokens + count)
                return count
        return 0

    def _chunk_length(self, seq: Sequence, budget_tokens: int) -> int:
        if seq.replay_outputs and seq.num_computed >= len(seq.prompt_ids):
            return 1
        length = min(seq.num_pending, budget_tokens)
        grid = self.config.checkpoint_grid
        if grid is not None:
            length = min(length, grid - seq.num_computed % grid)
        next_mark = next((m for m in seq.marks if m > seq.num_computed), None)
        if next_mark is not None:
            length = min(length, next_mark - seq.num_computed)
        return length

    def _fork(self, parent: Sequence, row: int, plan: StepPlan) -> None:
        """Create the other choices from ``parent``'s state after its prompt prefill (this step).

        Each child samples its first token from the parent's logits row.
        """
        assert parent.slot is not None
        length = parent.num_tokens
        parent_blocks = self._blocks_covering(parent, length)
        for choice in range(1, parent.pending_forks + 1):
            child = parent.spawn(choice)
            self._live[child.seq_id] = child
            self._choices[child.seq_id.request_id].append(child.seq_id)
            plan.samples.append(SampleSpec(child.seq_id, row, length, child.prompt_ids, child.output_ids))
            target = self._place_child(child)
            if target is not None:
                fork = Fork(parent.seq_id, parent.slot, parent_blocks, length, child.seq_id, *target)
                plan.forks.append(fork)
        parent.pending_forks = 0

    def _place_child(self, child: Sequence) -> tuple[int | None, tuple[int, ...]] | None:
        """Put a new child where its state copy goes: a free slot, else swap space, else nowhere
        (it prefills again from scratch). Return the copy's slot (None: host) and blocks, or None."""
        length = child.num_computed
        if self._has_room_for(child):
            self._allocator.enter(child, length)
            self._enter_running(child)
            return child.slot, tuple(child.block_ids)
        nbytes = self._state_nbytes(length)
        if self._swap.can_hold(nbytes):
            self._swap.reserve(child.seq_id, nbytes)
            self._enqueue(self._swapped, child, SequenceStatus.SWAPPED)
            return None, ()
        child.num_computed = 0
        self._enqueue(self._waiting, child, SequenceStatus.WAITING)
        return None

    def postprocess(self, plan: StepPlan, token_ids: Seq[int]) -> list[SequenceUpdate]:
        """Advance every fed sequence and append the sampled tokens (one per ``plan.samples`` entry)."""
        updates = self.postprocess_accepted(plan, [(token_id,) for token_id in token_ids])
        return [update for per_sample in updates for update in per_sample]

    def postprocess_accepted(self, plan: StepPlan, accepted: Seq[Seq[int]]) -> list[list[SequenceUpdate]]:
        """Advance every fed sequence and append, per ``plan.samples`` entry, its tokens in order: one,
        or for a verify chunk the accepted draft tokens and the token sampled after them.

        Appending stops at the token that finishes the sequence. Each appended token past the first
        means the draft token before it was fed and kept, so the state goes one row further; a verify
        chunk's state keeps as many rows as the updates returned for it (``len(updates[i])``).
        """
        if len(accepted) != len(plan.samples):
            raise ValueError(f"{len(accepted)} sampled tokens for {len(plan.samples)} sample rows")
        for chunk in plan.chunks:
            self._live[chunk.seq_id].num_computed = chunk.end - chunk.num_draft
        updates: list[list[SequenceUpdate]] = []
        for spec, tokens in zip(plan.samples, accepted, strict=True):
            if not 1 <= len(tokens) <= len(spec.draft) + 1 or list(tokens[:-1]) != list(spec.draft[: len(tokens) - 1]):
                raise ValueError(f"{spec.seq_id}: {list(tokens)} does not follow the draft {list(spec.draft)}")
            seq = self._live[spec.seq_id]
            appended: list[SequenceUpdate] = []
            for i, token_id in enumerate(tokens):
                if i:
                    seq.num_computed += 1
                appended.append(self._append(seq, token_id))
                if appended[-1].finish_reason is not None:
                    break
            updates.append(appended)
        return updates

    def _append(self, seq: Sequence, token_id: int) -> SequenceUpdate:
        emitted, reason = seq.append_sampled(token_id, self.config.max_model_len)
        final = None
        if reason is not None:
            if seq.slot is not None:
                blocks = self._blocks_covering(seq, seq.num_computed)
                final = FinalState(seq.slot, blocks, seq.tokens_between(0, seq.num_computed))
            self._finish(seq, reason)
        return SequenceUpdate(seq.seq_id, emitted, reason, final)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        for queue in (self._waiting, self._running, self._swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.seq_id in self._swap:
            self._swap.release(seq.seq_id)
        self._allocator.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self._live[seq.seq_id]
        request_id = seq.seq_id.request_id
        choices = self._choices.get(request_id)
        if choices is not None and not any(seq_id in self._live for seq_id in choices):
            del self._choices[request_id]

    def _enter_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self._running.append(seq)

    @staticmethod
    def _enqueue(queue: list[Sequence], seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        bisect.insort(queue, seq, key=lambda s: s.rank)

    def _blocks_covering(self, seq: Sequence, num_tokens: int) -> tuple[int, ...]:
        return tuple(seq.block_ids[: self._allocator.blocks_for(num_tokens)])
