"""The engine loop: schedule a step, run it on the model, turn the sampled tokens into outputs."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Sequence

from metrale.worker.engine.constraints import CompiledGrammar, GrammarCompiler
from metrale.worker.engine.request import Completion, GenerationResult, Request, RequestOutput
from metrale.worker.engine.runner import ModelRunner, TokenSampler
from metrale.worker.engine.sampler import SampledToken, Sampler
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.snapshots import Snapshot, SnapshotTaker
from metrale.worker.engine.state_ledger import StateLedger
from metrale.worker.model.interface import SequenceState, StatefulModel
from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.plan import SequenceUpdate, StepPlan
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
    ) -> None:
        _check_model_fits(model, config)
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
        self._runner.register(request.request_id, params, seed, grammar, frozenset(stop_ids))
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
        """Run one step; return what each choice produced in it."""
        plan = self._scheduler.schedule()
        sampled = self._runner.run(plan)
        return self._postprocess(plan, sampled)

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

    def _postprocess(self, plan: StepPlan, sampled: Sequence[SampledToken]) -> list[RequestOutput]:
        updates = self._scheduler.postprocess(plan, [token.token_id for token in sampled])
        self._snapshots += self._snapshot_taker.collect(
            self._requests, plan.chunks, updates, self._runner.export, self._scheduler.tokens
        )
        outputs = [self._output(update, token) for update, token in zip(updates, sampled, strict=True)]
        for update in updates:
            request_id = update.seq_id.request_id
            if update.finish_reason is not None and self._scheduler.is_finished(request_id):
                self._release(request_id)
        return outputs

    def _output(self, update: SequenceUpdate, token: SampledToken) -> RequestOutput:
        request = self._requests[update.seq_id.request_id]
        dead_end = self._runner.dead_end(update.seq_id) if update.finish_reason is FinishReason.STOP else None
        if dead_end is not None:  # it sampled a stop token only because its grammar allowed nothing else
            refused = f"the constrained output reached a dead end: {dead_end} (no complete output satisfies it)"
            return RequestOutput(
                request.request_id,
                update.seq_id.choice,
                (),
                (),
                (),
                True,
                FinishReason.REFUSED,
                len(request.prompt_ids),
                error=refused,
            )
        emitted = update.token_id is not None
        return RequestOutput(
            request_id=request.request_id,
            choice=update.seq_id.choice,
            token_ids=(token.token_id,) if emitted else (),
            logprobs=(token.logprob,) if emitted else (),
            top_logprobs=(token.top_logprobs,) if emitted else (),
            finished=update.finish_reason is not None,
            finish_reason=update.finish_reason,
            num_prompt_tokens=len(request.prompt_ids),
        )

    def _release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._snapshot_taker.forget(request_id)
        self._runner.release(request_id)


def _check_model_fits(model: StatefulModel, config: SchedulerConfig) -> None:
    if model.block_size != config.block_size:
        raise ValueError(f"the model's block size is {model.block_size}, the config's {config.block_size}")
    if model.num_slots < config.num_slots or model.num_blocks < config.num_blocks:
        raise ValueError(
            f"the config wants {config.num_slots} slots and {config.num_blocks} blocks; "
            f"the model has {model.num_slots} and {model.num_blocks}"
        )
