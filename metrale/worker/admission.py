"""From a queued ``GenerateRequest`` to an engine ``Request``, or the reason the worker refuses it."""

from __future__ import annotations

import random
import time

from metrale.shared.messages import GenerateRequest, ModelAnnouncement
from metrale.worker.request import Request, ResumePoint
from metrale.worker.sampling_params import SamplingParams
from metrale.worker.scheduler.sequence import Priority

SEED_LIMIT = 2**63
"""Seeds picked for requests without one lie in ``[0, SEED_LIMIT)``."""


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


def engine_request(
    message: GenerateRequest,
    seeds: random.Random,
    *,
    resume: ResumePoint | None = None,
    snapshots: bool = False,
) -> Request:
    """The engine's view of ``message``; a request without a seed gets one drawn from ``seeds``.

    The drawn seed is kept in the request's ``SamplingParams``, so the continuation is reproducible
    from it. ``resume`` starts it from a checkpoint; ``snapshots`` asks for checkpoints of it (at the
    positions the gateway marked, the grid, and the end). Raises ``ValueError`` for sampling settings
    the engine does not accept.
    """
    seed = message.seed if message.seed is not None else seeds.randrange(SEED_LIMIT)
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
    )
    return Request(
        request_id=message.request_id,
        prompt_ids=tuple(message.prompt_token_ids),
        params=params,
        priority=Priority[message.priority.name],
        arrival=message.created_at,
        resume=resume,
        snapshots=snapshots,
        checkpoint_marks=tuple(message.checkpoint_positions),
    )
