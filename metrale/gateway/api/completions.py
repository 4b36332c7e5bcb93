"""``POST /v1/completions``: text (or token-id) prompts continued, answered whole or streamed.

A list of prompts is one fleet request per prompt, each admitted and charged as a request of its own
(``streams/prompt_group.py``); choice ``i * n + j`` is prompt ``i``'s choice ``j``. ``echo`` puts the
prompt before each choice's text; with ``logprobs`` its tokens' logprobs come first (the first token's
``null``), scored by the worker in the prefill that fills the state. ``max_tokens`` 0 (with ``echo``
only) answers the prompt alone: the worker samples one token, as vLLM does, which is not shown nor
counted. vLLM's ``prompt_logprobs`` rides on each choice (not with ``stream``, as in vLLM).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import APIRouter, Request
from starlette.responses import Response

from metrale.gateway.api.answer.completion_renderer import CompletionOptions, CompletionRenderer, EchoedPrompt
from metrale.gateway.api.prepare.intake import Intake, requested_tokens, take_in
from metrale.gateway.api.prepare.off_loop import build_stop_automaton, compiles_grammar, run_off_loop
from metrale.gateway.api.prepare.prompts import completion_prompt_ids
from metrale.gateway.api.prepare.sampling import (
    RequestContext,
    build_submission,
    check_logprobs,
    check_prompt_logprobs,
    require,
)
from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.request_bodies import CompletionRequest
from metrale.gateway.request_limits import check_requests_work
from metrale.gateway.streams.delivery import Prepared, deliver
from metrale.gateway.streams.logprobs import LogprobFormatter
from metrale.gateway.streams.prompt_group import deliver_group
from metrale.gateway.streams.submission import Submission
from metrale.shared.messages import Priority

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    """Create a text completion (OpenAI-compatible, with Metrale's and vLLM's extensions)."""
    intake = await take_in(request, CompletionRequest, "cmpl")
    body = intake.body
    if len(body.prompts) == 1:
        async with fleet_places(intake, 1):
            prepared = await prepare_completion(intake)
            return await deliver(intake.gateway, prepared, stream=body.stream, include_usage=body.include_usage)
    async with fleet_places(intake, len(body.prompts)):
        submissions, renderer = await build_completions(body, intake.context, intake.model)
        limits = intake.gateway.settings.request_limits
        check_requests_work([s.request for s in submissions], limits, **_work_params(body))
        return await deliver_group(
            intake.gateway, submissions, renderer, n=body.n, stream=body.stream, include_usage=body.include_usage
        )


@asynccontextmanager
async def fleet_places(intake: Intake[CompletionRequest], count: int) -> AsyncIterator[None]:
    """Admission to the fleet for each of ``count`` prompts, as ``count`` requests (ids ``prompt_id``)."""
    context, body = intake.context, intake.body
    tokens = requested_tokens(body)
    async with AsyncExitStack() as stack:
        for index in range(count):
            request_id = prompt_request_id(context.request_id, index, count)
            place = intake.gateway.admission.fleet_place(
                request_id, Priority(body.priority), context.created_at, tokens
            )
            await stack.enter_async_context(place)
        yield


def prompt_request_id(request_id: str, index: int, count: int) -> str:
    """The fleet request id of prompt ``index`` of ``count``: the request's own id for a single prompt."""
    return request_id if count == 1 else f"{request_id}-{index}"


async def prepare_completion(intake: Intake[CompletionRequest]) -> Prepared:
    """Everything the route checks and builds before it submits one prompt (also what a batch line
    goes through)."""
    prepared = await build_completion(intake.body, intake.context, intake.model)
    limits = intake.gateway.settings.request_limits
    check_requests_work([prepared.submission.request], limits, **_work_params(intake.body))
    return prepared


async def build_completion(body: CompletionRequest, context: RequestContext, model: ServedModel) -> Prepared:
    """``prepare_completion`` for a known model (also what ``met generate`` runs a batch line with)."""
    require(
        len(body.prompts) == 1,
        f"this takes one prompt, got {len(body.prompts)}: send a list of prompts to /v1/completions itself",
        "prompt",
    )
    submissions, renderer = await build_completions(body, context, model)
    return Prepared(submissions[0], renderer)


async def build_completions(
    body: CompletionRequest, context: RequestContext, model: ServedModel
) -> tuple[list[Submission], CompletionRenderer]:
    """One ``Submission`` per prompt, and the renderer of their joint answer."""
    body.refuse_unsupported(body.n)
    options = completion_options(body)
    prompts = body.prompts
    submissions, echoed = [], []
    for index, prompt in enumerate(prompts):
        prompt_ids = await completion_prompt_ids(model.tokenizer, prompt, max_model_len=model.max_model_len)
        prompt_context = dataclasses.replace(
            context, request_id=prompt_request_id(context.request_id, index, len(prompts))
        )
        build = functools.partial(
            build_submission,
            body,
            prompt_context,
            model,
            prompt_ids=prompt_ids,
            budget=1 if options.echo_only else body.token_budget,
            logprobs=body.logprobs,
            prompt_param="prompt",
            prompt_logprobs=options.worker_prompt_logprobs,
        )
        submission = await run_off_loop(build, inline=not compiles_grammar(body))  # a grammar compiles off the loop
        submissions.append(submission)
        text = prompt if isinstance(prompt, str) else model.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        echoed.append(EchoedPrompt(text, prompt_ids, submission.prompt_scores))
    await build_stop_automaton(body.stop_strings)
    wants_formatter = body.logprobs is not None or body.prompt_logprobs is not None
    renderer = CompletionRenderer(
        request_id=context.request_id,
        model=body.model,
        fingerprint=model.announcement.fingerprint,
        n=body.n,
        prompts=echoed,
        options=options,
        logprobs=LogprobFormatter(model.tokenizer) if wants_formatter else None,
    )
    return submissions, renderer


def completion_options(body: CompletionRequest) -> CompletionOptions:
    """What the body asks of the answer, each field's value checked (400 naming it)."""
    check_logprobs(body.logprobs, "logprobs")
    check_prompt_logprobs(body.prompt_logprobs, stream=body.stream)
    require(len(body.prompts) > 0, "the prompt list is empty", "prompt")
    require(
        body.max_tokens != 0 or body.echo,
        "max_tokens must be >= 1, got 0 (0 is allowed with echo: the prompt alone is answered)",
        "max_tokens",
    )
    return CompletionOptions(
        echo=body.echo,
        echo_only=body.echo and body.max_tokens == 0,
        logprobs=body.logprobs,
        prompt_logprobs=body.prompt_logprobs,
    )


def _work_params(body: CompletionRequest) -> dict[str, str]:
    """The fields a request over the work bound is blamed on: its prompts' logprobs when they alone
    pass it, else the list of prompts, else the token limit."""
    budget = "prompt" if len(body.prompts) > 1 else "max_tokens"
    return {"param": budget, "prompt_param": "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs"}
