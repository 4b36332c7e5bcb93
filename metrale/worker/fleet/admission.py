"""From a queued ``GenerateRequest`` to an engine ``Request``, or the reason the worker refuses it.

A request that ran before on another worker continues from its durable record (``continuation``):
choice 0's emitted tokens are prefilled after the prompt and sampling goes on with the recorded seed
at the next position, so the tokens are those of an undisturbed run.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from metrale.shared.messages import GenerateRequest, ModelAnnouncement
from metrale.shared.record import RunRecord
from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.engine.request import Request, ResumePoint
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.scheduler.sequence import Priority

SEED_LIMIT = 2**63
"""Seeds picked for requests without one lie in ``[0, SEED_LIMIT)``."""


@dataclass(frozen=True, slots=True)
class Continuation:
    """What a request already did on other workers: choice 0's emitted tokens, and the seed it
    samples with (None: no worker drew one yet)."""

    generated: tuple[int, ...] = ()
    seed: int | None = None


def refusal(message: GenerateRequest, model: ModelAnnouncement, now: float | None = None) -> str | None:
    """Why this worker cannot run ``message`` (wrong model, token ids outside the vocabulary, past its
    deadline), or None. The engine's own checks (context length, sampling ranges) come later."""
    if message.model != model.model:
        return f"model {message.model!r} is not served by this worker (it serves {model.model!r})"
    outside = [token for token in message.prompt_token_ids if not 0 <= token < model.vocab_size]
    if outside:
        return f"prompt token id {outside[0]} is outside the vocabulary [0, {model.vocab_size})"
    now = time.time() if now is None else now
    if message.deadline is not None and message.deadline <= now:
        return "the request's deadline passed before it started"
    return None


def continuation(message: GenerateRequest, record: RunRecord | None) -> Continuation | str:
    """How to continue ``message`` from its ``record``, or why it cannot be continued exactly.

    Only ``n == 1`` continues after tokens were sent: the choices of ``n > 1`` fork from the state
    after the prompt, which no decode checkpoint holds.
    """
    if record is None or not record.events:
        return Continuation(seed=record.seed if record is not None else None)
    sent = len(record.events)
    if message.n > 1:
        return f"a request with n > 1 cannot continue on another worker once it sent events ({sent} sent)"
    if not record.is_contiguous:
        return "its record is missing events (did Redis restart?)"
    if record.is_choice_finished(0):
        return "it already finished"
    seed = message.seed if message.seed is not None else record.seed
    if seed is None:
        return "its record does not name the seed it samples with"
    return Continuation(tuple(record.token_ids(0)), seed)


def undeliverable(deliveries: int, max_deliveries: int) -> str | None:
    """Why a request handed to workers ``deliveries`` times is given up (None: try it again)."""
    if deliveries <= max_deliveries:
        return None
    return f"the request was given to {deliveries} workers and each was lost while running it; giving up"


def continuation_checkpoints(prompt_len: int, generated: int, interval: int) -> list[int]:
    """Where a continued request may find a checkpoint of its own: after the prompt plus every multiple
    of ``interval`` output tokens (0: none), and after all but the last generated token (where a
    stopping worker suspends it). None before it generated anything."""
    if generated == 0:
        return []
    newest = prompt_len + generated - 1
    decode = range(prompt_len, newest, interval) if interval > 0 else range(0)
    return [*decode, newest]


def resume_point(
    manager: CheckpointManager, message: GenerateRequest, generated: Sequence[int], decode_interval: int
) -> ResumePoint | None:
    """The longest valid checkpoint of prompt + ``generated``: the session's, the grid's, the marked
    positions', or (continuing a request) a decode checkpoint of it."""
    prompt = message.prompt_token_ids
    decode_marks = continuation_checkpoints(len(prompt), len(generated), decode_interval)
    lookup = manager.find(
        message.tenant,
        [*prompt, *generated],
        session_id=message.session_id,
        marks=[*message.checkpoint_positions, *decode_marks],
    )
    return ResumePoint(lookup.resume.length, lookup.resume.state) if lookup.resume is not None else None


def keeps_final_state(message: GenerateRequest) -> bool:
    """Whether the state at the end of ``message`` is checkpointed: in a session, where the next turn
    looks it up (the session's newest), or when the gateway asks (a stored response). Otherwise no later
    request could find it: a lookup tries only the session's newest, grid multiples and marks."""
    return message.session_id is not None or message.keep_final_state


def seed_for(request_id: str) -> int:
    """The seed of a request that brings none: a hash of its (unique) id, so every worker that ever runs
    it — the first, its heir after a failover, and a starved one whose heartbeat lapsed while its heir
    started — samples the same tokens from the same state."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"met-seed").digest()
    return int.from_bytes(digest, "big") % SEED_LIMIT


def engine_request(
    message: GenerateRequest,
    *,
    resume: ResumePoint | None = None,
    snapshots: bool = False,
    earlier: Continuation | None = None,
    scores_prompt: bool = True,
) -> Request:
    """The engine's view of ``message``; a request without a seed gets ``seed_for`` its id.

    That seed is kept in the request's ``SamplingParams`` (and its record), so the continuation is
    reproducible from it. ``resume`` starts it from a checkpoint; ``snapshots`` asks for checkpoints of it (at the
    positions the gateway marked, the grid, decode checkpoints and the end). ``earlier`` continues
    what other workers did (its recorded seed wins). ``scores_prompt`` False leaves out the prompt
    logprobs the message asks for (its record holds them all already). Raises ``ValueError`` for
    sampling settings the engine does not accept.
    """
    earlier = earlier or Continuation()
    seed = message.seed if message.seed is not None else earlier.seed
    if seed is None:
        seed = seed_for(message.request_id)
    params = SamplingParams(
        max_tokens=message.max_tokens,
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        seed=seed,
        n=message.n,
        logprobs=message.logprobs,
        logit_bias=tuple(message.logit_bias),
        grammar=message.grammar,
        prompt_logprobs=message.prompt_logprobs if scores_prompt else None,
        speculative=message.speculative,
    )
    return Request(
        request_id=message.request_id,
        prompt_ids=tuple(message.prompt_token_ids),
        params=params,
        priority=Priority[message.priority.name],
        arrival=message.created_at,
        resume=resume,
        snapshots=snapshots,
        final_snapshot=keeps_final_state(message),
        checkpoint_marks=tuple(message.checkpoint_positions),
        generated=earlier.generated,
    )
