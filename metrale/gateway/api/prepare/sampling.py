"""From a validated request body to the ``GenerateRequest`` a worker runs: value checks and limits.

Every check raises ``BadRequest`` naming the offending field (HTTP 400); a prompt that leaves no room
in the model's context raises ``PromptTooLong`` with both numbers. Ranges follow the worker's
``SamplingParams`` (vLLM's), so a request that passes here is never refused by a worker for its
parameters.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from metrale.gateway.api.prepare.structured_outputs import request_grammar
from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.request_bodies import SamplingFields
from metrale.gateway.request_limits import MAX_LOGIT_BIAS_ENTRIES
from metrale.gateway.streams.choice import ChoiceDecoder
from metrale.gateway.streams.prompt_scores import PromptScores
from metrale.gateway.streams.submission import Submission
from metrale.shared.errors import BadRequest, PromptTooLong
from metrale.shared.keys import check_segment
from metrale.shared.messages import GenerateRequest, Priority

MAX_CHOICES = 128
"""The most choices (``n``) one request may ask for (OpenAI's limit)."""

MAX_LOGPROBS = 20
"""The most alternatives per token (OpenAI's limit; the worker's too)."""

MAX_LOGIT_BIAS = 100.0
"""A ``logit_bias`` value lies in ``[-100, 100]`` (OpenAI's range; the worker's too)."""

_SEED_RANGE = (-(2**63), 2**64 - 1)  # what msgpack carries as an integer


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the gateway decided about a request besides its body."""

    request_id: str
    tenant: str
    session_id: str | None
    deadline: float
    created_at: float


def require(condition: bool, message: str, param: str) -> None:
    """Raise ``BadRequest(message, param=param)`` unless ``condition`` holds."""
    if not condition:
        raise BadRequest(message, param=param)


def check_sampling(body: SamplingFields, vocab_size: int) -> None:
    """Check the value of every sampling field of ``body``."""
    _check_number("temperature", body.temperature, low=0.0)
    _check_number("top_p", body.top_p, low=0.0, high=1.0, open_low=True)
    require(body.top_k >= -1, f"top_k must be >= 0 (or -1 to disable), got {body.top_k}", "top_k")
    _check_number("min_p", body.min_p, low=0.0, high=1.0)
    _check_number("presence_penalty", body.presence_penalty, low=-2.0, high=2.0)
    _check_number("frequency_penalty", body.frequency_penalty, low=-2.0, high=2.0)
    _check_number("repetition_penalty", body.repetition_penalty, low=0.0, open_low=True)
    require(1 <= body.n <= MAX_CHOICES, f"n must be in [1, {MAX_CHOICES}], got {body.n}", "n")
    low, high = _SEED_RANGE
    require(body.seed is None or low <= body.seed <= high, f"seed must be in [{low}, {high}]", "seed")
    require(all(body.stop_strings), "stop strings must not be empty", "stop")
    bad_ids = [t for t in body.stop_token_ids if not 0 <= t < vocab_size]
    require(not bad_ids, f"stop_token_ids {bad_ids} are outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    if body.stream_options is not None:
        body.stream_options.refuse_unsupported()


def logit_bias_pairs(logit_bias: dict[str, float] | None, vocab_size: int) -> list[tuple[int, float]]:
    """``logit_bias`` (token id strings -> bias) as ``(token_id, bias)`` pairs, each id inside the
    vocabulary and each bias in ``[-100, 100]``; at most ``MAX_LOGIT_BIAS_ENTRIES`` of them."""
    if not logit_bias:
        return []
    count = len(logit_bias)
    require(
        count <= MAX_LOGIT_BIAS_ENTRIES,
        f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {count}",
        "logit_bias",
    )
    pairs = []
    for key, bias in logit_bias.items():
        token_id = int(key) if key.isascii() and key.isdecimal() else -1
        require(
            0 <= token_id < vocab_size,
            f"logit_bias key {key!r} is not a token id in the vocabulary [0, {vocab_size})",
            "logit_bias",
        )
        ok = math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
        require(ok, f"logit_bias values must be in [-100, 100], got {bias:g} for token {key}", "logit_bias")
        pairs.append((token_id, float(bias)))
    require(len({t for t, _ in pairs}) == len(pairs), "logit_bias names a token more than once", "logit_bias")
    return pairs


def check_logprobs(count: int | None, param: str) -> None:
    """``count`` alternatives per token must lie in ``[0, MAX_LOGPROBS]``."""
    ok = count is None or 0 <= count <= MAX_LOGPROBS
    require(ok, f"{param} must be in [0, {MAX_LOGPROBS}], got {count}", param)


def check_prompt_logprobs(count: int | None, *, stream: bool) -> None:
    """vLLM's ``prompt_logprobs``: ``count`` alternatives in ``[0, MAX_LOGPROBS]``, and not streamed
    (vLLM refuses it with ``stream`` too)."""
    check_logprobs(count, "prompt_logprobs")
    require(
        count is None or not stream,
        "prompt_logprobs are not available when stream is true (as in vLLM); use echo with logprobs",
        "prompt_logprobs",
    )


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """A prompt must hold at least one token, each inside the vocabulary."""
    require(len(prompt_ids) > 0, "the prompt is empty", param)
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    require(not bad, f"prompt token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})", param)


def resolve_max_tokens(budget: int | None, prompt_len: int, max_model_len: int, *, prompt_param: str) -> int:
    """How many tokens a choice may generate: ``budget``, or whatever the context leaves when unset.

    Raises ``PromptTooLong`` when the prompt plus ``budget`` exceed ``max_model_len``.
    """
    require(budget is None or budget >= 1, f"max_tokens must be >= 1, got {budget}", "max_tokens")
    if prompt_len >= max_model_len:
        raise PromptTooLong(max_model_len, prompt_len, param=prompt_param)
    if budget is None:
        return max_model_len - prompt_len
    if prompt_len + budget > max_model_len:
        raise PromptTooLong(max_model_len, prompt_len + budget, param="max_tokens")
    return budget


def session_id_of(body_session: str | None, header_session: str | None) -> str | None:
    """The session a request belongs to: the body's ``session`` or else the ``X-Session-Id`` header."""
    session = body_session if body_session is not None else header_session
    if session is None:
        return None
    return checked_session_id(session, param="session")


def checked_session_id(session: str, *, param: str) -> str:
    """``session`` if it is a valid session id (the one rule for chat, headers and the session routes:
    the characters a Redis key segment allows), else ``BadRequest`` naming ``param``."""
    try:
        return check_segment(session, "session id")
    except ValueError as error:
        raise BadRequest(str(error), param=param) from None


def build_submission(
    body: SamplingFields,
    context: RequestContext,
    model: ServedModel,
    *,
    prompt_ids: list[int],
    budget: int | None,
    logprobs: int | None,
    prompt_param: str,
    checkpoint_positions: Sequence[int] = (),
    on_complete: Callable[[ChoiceDecoder], Awaitable[None]] | None = None,
    keep_final_state: bool = False,
    tool_grammar: str | None = None,
    tool_param: str = "tool_choice",
    keeps_special_tokens: bool = False,
    prompt_logprobs: int | None = None,
) -> Submission:
    """Check ``body`` against ``model`` and turn it into a ``Submission``; ``tool_grammar`` constrains
    tool calls, its errors blamed on ``tool_param`` (see ``structured_outputs.request_grammar``),
    ``keeps_special_tokens`` keeps special tokens' text in the output (a tool-call format written in
    them). ``prompt_logprobs`` asks the worker for the prompt tokens' logprobs with that many
    alternatives each, gathered in the submission's ``prompt_scores``."""
    check_sampling(body, model.vocab_size)
    grammar = request_grammar(body, model, tool_grammar, tool_param)
    check_prompt_ids(prompt_ids, model.vocab_size, prompt_param)
    max_tokens = resolve_max_tokens(budget, len(prompt_ids), model.max_model_len, prompt_param=prompt_param)
    request = GenerateRequest(
        request_id=context.request_id,
        model=body.model,
        tenant=context.tenant,
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=float(body.temperature),
        top_p=float(body.top_p),
        top_k=max(body.top_k, 0),
        min_p=float(body.min_p),
        presence_penalty=float(body.presence_penalty),
        frequency_penalty=float(body.frequency_penalty),
        repetition_penalty=float(body.repetition_penalty),
        stop_token_ids=list(body.stop_token_ids),
        ignore_eos=body.ignore_eos,
        seed=body.seed,
        n=body.n,
        logprobs=logprobs,
        priority=Priority(body.priority),
        session_id=context.session_id,
        checkpoint_positions=list(checkpoint_positions),
        deadline=context.deadline,
        created_at=context.created_at,
        live_events=body.stream,
        keep_final_state=keep_final_state,
        logit_bias=logit_bias_pairs(body.logit_bias, model.vocab_size),
        grammar=grammar,
        prompt_logprobs=prompt_logprobs,
        speculative=body.speculative,
    )
    scores = PromptScores() if prompt_logprobs is not None else None
    return Submission(request, model, tuple(body.stop_strings), on_complete, keeps_special_tokens, scores)


def _check_number(name: str, value: float, *, low: float, high: float = math.inf, open_low: bool = False) -> None:
    above = value > low if open_low else value >= low
    opening = "(" if open_low else "["
    closing = ")" if math.isinf(high) else "]"
    ok = math.isfinite(value) and above and value <= high
    require(ok, f"{name} must be finite and in {opening}{low:g}, {high:g}{closing}, got {value:g}", name)
