"""The engine loop: schedule a step, run it on the model, turn the sampled tokens into outputs."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Sequence

from metrale.worker.engine.constraints import CompiledGrammar, GrammarCompiler
from metrale.worker.engine.draft_length import DraftLengthPolicy, DraftLengths
from metrale.worker.engine.prompt_logprobs import PromptLogprobs
from metrale.worker.engine.request import Completion, GenerationResult, Request, RequestOutput
from metrale.worker.engine.runner import ModelRunner, TokenSampler
from metrale.worker.engine.sampler import SampledToken, Sampler
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.snapshots import Snapshot, SnapshotTaker
from metrale.worker.engine.speculation import Drafter, SpeculationStats, SpeculationTally
from metrale.worker.engine.state_ledger import StateLedger
from metrale.worker.model.interface import SequenceState, StatefulModel
from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.plan import ChunkPlan, SequenceUpdate, StepPlan
from metrale.worker.scheduler.scheduler import Scheduler, SchedulerStats
from metrale.worker.scheduler.sequence import FinishReason, SequenceId, StopParams

_SEED_LIMIT = 2**63


class Engine:
    """Continuous batching over a ``StatefulModel``.

    ``eos_token_ids`` stop every request that does not set ``ignore_eos``. ``seed`` seeds the
    per-request seeds picked for requests without one. ``ledger`` checks every state move; pass one
    to inspect it. ``decode_checkpoint_interval`` (None: off) adds decode checkpoints to the
    snapshots of requests that ask for them (see ``SnapshotTaker``). ``grammars`` compiles the
    grammars of constrained requests (``SamplingParams.grammar``); without it they are refused.
    ``drafter`` (None: off) turns on speculative decoding: decoding choices verify the draft tokens it
    proposes, and emit exactly the tokens, logprobs and finish plain decoding would (see
    ``speculation.py``); constrained choices, and requests with ``SamplingParams.speculative`` False,
    decode plainly. ``draft_lengths`` (default: ``DraftLengths``, adaptive) decides per step how many
    draft tokens each decoding choice verifies. ``speculation_stats`` counts the drafts verified and
    accepted.
    """

    def __init__(
        self,
        model: StatefulModel,
        config: SchedulerConfig,
        sampler: TokenSampler | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        seed: int | None = None,
        ledger: StateLedger | None = None,
        decode_checkpoint_interval: int | None = None,
        grammars: GrammarCompiler | None = None,
        drafter: Drafter | None = None,
        draft_lengths: DraftLengthPolicy | None = None,
    ) -> None:
        _check_model_fits(model, config)
        if draft_lengths is not None and drafter is None:
            raise ValueError("draft_lengths without a drafter: there is nothing to draft")
        self._drafter = drafter
        self._draft_lengths = draft_lengths or DraftLengths()
        self._speculation = SpeculationTally()
        self._drafts = _EngineDrafts(self) if drafter is not None else None
        self._grammars = grammars
        self.config = config
        self._scheduler = Scheduler(config, model.state_nbytes)
        self._runner = ModelRunner(model, sampler or Sampler(), ledger or StateLedger())
        self._eos_token_ids = frozenset(eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._seeds = random.Random(seed)
        self._generate_ids = itertools.count()
        self._snapshot_taker = SnapshotTaker(config.checkpoint_grid, decode_checkpoint_interval)
        self._snapshots: list[Snapshot] = []

    def add_request(self, request: Request) -> None:
        """Queue ``request``. Raises ``PromptTooLongError`` (a ``ValueError``) or ``ValueError``."""
        params = request.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self._eos_token_ids
        if params.prompt_logprobs is not None and request.resume is not None:
            raise ValueError("prompt logprobs are scored by the prefill from position 0: not from a checkpoint")
        grammar = self._compile_grammar(params.grammar, stop_ids)
        stop = StopParams(params.max_tokens, frozenset(stop_ids), request.include_stop_token)
        resume_length = request.resume.length if request.resume is not None else 0
        self._scheduler.add(
            request.request_id,
            request.prompt_ids,
            stop,
            request.priority,
            params.n,
            resume_length=resume_length,
            marks=request.checkpoint_marks,
            generated=request.generated,
        )
        seed = params.seed if params.seed is not None else self._seeds.randrange(_SEED_LIMIT)
        self._runner.register(request.request_id, params, seed, grammar, frozenset(stop_ids), request.prompt_ids)
        if request.resume is not None:
            self._runner.park(SequenceId(request.request_id, 0), request.resume.state, resume_length)
        self._requests[request.request_id] = request

    def _compile_grammar(self, grammar: str | None, stop_ids: set[int]) -> CompiledGrammar | None:
        """The compiled grammar of a request (None: unconstrained); raises ``ValueError`` when it
        does not compile, or when the request has no stop token to end on once it is complete."""
        if grammar is None:
            return None
        if self._grammars is None:
            raise ValueError("this engine constrains no decoding: it was built without a grammar compiler")
        if not stop_ids:
            raise ValueError("a grammar needs a stop token to end on: ignore_eos leaves none without stop_token_ids")
        return self._grammars.compile(grammar)

    def take_snapshots(self) -> list[Snapshot]:
        """The states copied out for checkpoints since the last call (requests with ``snapshots``)."""
        taken, self._snapshots = self._snapshots, []
        return taken

    def suspend(self, request_id: str) -> Snapshot | None:
        """Stop a request here so that another engine can continue it; return its exact state.

        The snapshot is choice 0's state after every token it consumed so far (None when it holds no
        state yet, or the request is unknown). The request is then aborted, freeing what it held.
        """
        if request_id not in self._requests:
            return None
        held = self._scheduler.held_state(request_id)
        snapshot = None
        if held is not None:
            state: SequenceState | None
            if held.slot is not None:
                state = self._runner.export(held.slot, held.block_ids, len(held.consumed))
            else:
                state = self._runner.parked_state(held.seq_id)
            if state is not None:
                snapshot = Snapshot(request_id, held.consumed, state, final=False, decode=True)
        self.abort(request_id)
        return snapshot

    def abort(self, request_id: str) -> bool:
        """Cancel a request at any moment, freeing its slots, blocks and swap space; False if unknown."""
        if request_id not in self._requests:
            return False
        self._scheduler.abort(request_id)
        self._release(request_id)
        return True

    def step(self) -> list[RequestOutput]:
        """Run one step; return what each choice produced in it (prompt logprobs first)."""
        plan = self._scheduler.schedule(self._drafts)
        accepted = self._runner.run_accepting(plan)
        prompt_outputs = [self._prompt_output(*scored) for scored in self._runner.take_prompt_logprobs()]
        return prompt_outputs + self._postprocess(plan, accepted)

    def _draft_counts(self, caps: Sequence[tuple[SequenceId, int]], other_rows: int) -> Sequence[int]:
        """Per decoding choice of a step, how many draft tokens to ask the
        drafter for — none for a constrained choice or one whose request turned speculation off, at most
        the drafter's longest, then as ``draft_lengths`` decides."""
        assert self._drafter is not None
        longest = self._drafter.num_speculative_tokens
        allowed = [(seq_id, min(cap, longest) if self._runner.wants_drafts(seq_id) else 0) for seq_id, cap in caps]
        return self._draft_lengths.lengths(allowed, other_rows)

    def _propose(
        self, seq_id: SequenceId, prompt_ids: Sequence[int], output_ids: Sequence[int], at_most: int
    ) -> Sequence[int]:
        """The drafter's tokens for a decoding choice. A choice whose
        request takes decode checkpoints never verifies past the next one, so some step's state lands on it."""
        assert self._drafter is not None
        interval = self._snapshot_taker.decode_interval
        request = self._requests.get(seq_id.request_id)
        if interval is not None and request is not None and request.snapshots and seq_id.choice == 0:
            consumed = len(output_ids) - 1  # outputs the state holds before this step
            at_most = min(at_most, interval - consumed % interval - 1)
        if at_most < 1:
            return ()
        return self._drafter.propose(seq_id, prompt_ids, output_ids, at_most)

    def speculation_stats(self) -> SpeculationStats:
        """Drafts verified and accepted since the engine started (zeros when speculation is off)."""
        return self._speculation.stats()

    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        """Queue lengths, free slots and blocks, swap bytes in use, preemptions so far."""
        return self._scheduler.stats()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        progress: Callable[[GenerationResult], None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt concurrently to completion; results in prompt order.

        ``params`` is one setting for all prompts or one per prompt. ``progress`` is called with each
        result as it finishes. Meant for offline use: outputs of other requests are dropped meanwhile.
        """
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        results = self._submit_all(prompts, per_prompt)
        pending = set(results)
        while pending:
            if not self.has_unfinished():
                raise RuntimeError(f"the engine stopped with {len(pending)} prompts unfinished")
            for output in self.step():
                result = results.get(output.request_id)
                if result is None:
                    continue
                if output.prompt_logprobs is not None:
                    result.prompt_logprobs.extend(output.prompt_logprobs.logprobs)
                    result.prompt_top_logprobs.extend(output.prompt_logprobs.top_logprobs)
                    continue
                result.completions[output.choice].extend(output)
                if result.finished:
                    pending.discard(result.request_id)
                    if progress is not None:
                        progress(result)
        return list(results.values())

    def _submit_all(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> dict[str, GenerationResult]:
        """Add one request per prompt; if any is refused, withdraw those already added and re-raise."""
        results: dict[str, GenerationResult] = {}
        try:
            for prompt, prompt_params in zip(prompts, params, strict=True):
                request = Request(f"generate-{next(self._generate_ids)}", tuple(prompt), prompt_params)
                self.add_request(request)
                completions = [Completion() for _ in range(prompt_params.n)]
                results[request.request_id] = GenerationResult(request.request_id, request.prompt_ids, completions)
        except ValueError:
            for request_id in results:
                self.abort(request_id)
            raise
        return results

    def _postprocess(self, plan: StepPlan, accepted: Sequence[Sequence[SampledToken]]) -> list[RequestOutput]:
        for spec, tokens in zip(plan.samples, accepted, strict=True):
            if spec.draft:
                self._speculation.record(len(spec.draft), len(tokens) - 1)
                self._draft_lengths.record(spec.seq_id, len(spec.draft), len(tokens) - 1)
        updates = self._scheduler.postprocess_accepted(
            plan, [[token.token_id for token in tokens] for tokens in accepted]
        )
        consumed = self._settle_verified(plan, updates)
        flat = [update for per_sample in updates for update in per_sample]
        self._snapshots += self._snapshot_taker.collect(
            self._requests, consumed, flat, self._runner.export, self._scheduler.tokens
        )
        outputs = [self._output(per_sample, tokens) for per_sample, tokens in zip(updates, accepted, strict=True)]
        for update in flat:
            request_id = update.seq_id.request_id
            if update.finish_reason is not None and self._scheduler.is_finished(request_id):
                self._release(request_id)
        return outputs

    def _settle_verified(self, plan: StepPlan, updates: Sequence[Sequence[SequenceUpdate]]) -> list[ChunkPlan]:
        """Settle each verify chunk's state on the rows its accepted tokens consumed (one per token
        appended: the newest sampled token, then each accepted draft token that another followed);
        return the chunks as the states consumed them."""
        if not any(chunk.num_draft for chunk in plan.chunks):
            return plan.chunks
        rows_of = {spec.row: len(per_sample) for spec, per_sample in zip(plan.samples, updates, strict=True)}
        consumed = []
        for index, chunk in enumerate(plan.chunks):
            if chunk.num_draft:
                rows = rows_of[index]
                self._runner.settle(chunk, rows)
                chunk = ChunkPlan(chunk.seq_id, chunk.slot, chunk.block_ids, chunk.start, chunk.token_ids[:rows], True)
            consumed.append(chunk)
        return consumed

    def _prompt_output(self, request_id: str, scored: PromptLogprobs) -> RequestOutput:
        prompt_len = len(self._requests[request_id].prompt_ids)
        return RequestOutput(request_id, 0, (), (), (), False, None, prompt_len, prompt_logprobs=scored)

    def _output(self, updates: Sequence[SequenceUpdate], tokens: Sequence[SampledToken]) -> RequestOutput:
        """One choice's output of this step: the tokens its updates emitted (several for a verify chunk)."""
        last = updates[-1]
        request = self._requests[last.seq_id.request_id]
        dead_end = self._runner.dead_end(last.seq_id) if last.finish_reason is FinishReason.STOP else None
        if dead_end is not None:  # it sampled a stop token only because its grammar allowed nothing else
            refused = f"the constrained output reached a dead end: {dead_end} (no complete output satisfies it)"
            return RequestOutput(
                request.request_id,
                last.seq_id.choice,
                (),
                (),
                (),
                True,
                FinishReason.REFUSED,
                len(request.prompt_ids),
                error=refused,
            )
        emitted = [token for update, token in zip(updates, tokens, strict=False) if update.token_id is not None]
        return RequestOutput(
            request_id=request.request_id,
            choice=last.seq_id.choice,
            token_ids=tuple(token.token_id for token in emitted),
            logprobs=tuple(token.logprob for token in emitted),
            top_logprobs=tuple(token.top_logprobs for token in emitted),
            finished=last.finish_reason is not None,
            finish_reason=last.finish_reason,
            num_prompt_tokens=len(request.prompt_ids),
        )

    def _release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._snapshot_taker.forget(request_id)
        self._draft_lengths.forget(request_id)
        if self._drafter is not None:
            self._drafter.forget(request_id)
        self._runner.release(request_id)


class _EngineDrafts:
    """The scheduler's ``DraftSource`` over an engine's drafter and draft length policy."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def lengths(self, caps: Sequence[tuple[SequenceId, int]], other_rows: int) -> Sequence[int]:
        return self._engine._draft_counts(caps, other_rows)

    def propose(
        self, seq_id: SequenceId, prompt_ids: Sequence[int], output_ids: Sequence[int], at_most: int
    ) -> Sequence[int]:
        return self._engine._propose(seq_id, prompt_ids, output_ids, at_most)


def _check_model_fits(model: StatefulModel, config: SchedulerConfig) -> None:
    if model.block_size != config.block_size:
        raise ValueError(f"the model's block size is {model.block_size}, the config's {config.block_size}")
    if model.num_slots < config.num_slots or model.num_blocks < config.num_blocks:
        raise ValueError(
            f"the config wants {config.num_slots} slots and {config.num_blocks} blocks; "
            f"the model has {model.num_slots} and {model.num_blocks}"
        )
