"""``/v1/responses``: create (whole or streamed), retrieve, delete, ``input_items``, cancel.

The server owns the conversation: a response made with ``previous_response_id`` continues from the
exact tokens of the one before (prompt plus reply as generated), resuming from its checkpoint on any
worker. Stored responses belong to their tenant (another API key gets 404) and live
``response_ttl_s``.
"""

from __future__ import annotations

import asyncio
import functools
from contextlib import AsyncExitStack
from typing import Any, Literal, NamedTuple

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response

from metrale.gateway.api.answer.answer_parser import reasoning_start
from metrale.gateway.api.background_responses import cancel_background, create_in_background, stream_events
from metrale.gateway.api.prepare.intake import Intake, fleet_place, take_in
from metrale.gateway.api.prepare.off_loop import compiles_grammar, run_off_loop
from metrale.gateway.api.prepare.prompts import INLINE_PROMPT_CHARS
from metrale.gateway.api.prepare.sampling import build_submission
from metrale.gateway.api.prepare.tools import ToolPlan
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.gateway.responses.conversation import ResponsePrompt, response_prompt
from metrale.gateway.responses.events import response_events
from metrale.gateway.responses.items import chat_messages, input_items, items_chars
from metrale.gateway.responses.refusals import refuse_unsupported
from metrale.gateway.responses.store import BackgroundResponse, StoredResponse, UnstoredResponse
from metrale.gateway.responses.tools import plan_response_tools
from metrale.gateway.responses.turn import Turn
from metrale.gateway.state import Gateway, gateway_of
from metrale.gateway.streams.generation import start_generation
from metrale.gateway.streams.streaming import sse_response
from metrale.gateway.streams.submission import Submission
from metrale.shared.errors import BadRequest, NotFound
from metrale.shared.keys import check_segment

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(request: Request) -> Response:
    """Create a response (OpenAI Responses API: text and function calls in and out, a thinking model's
    reasoning as a ``reasoning`` item, structured outputs), in the foreground or, with ``background``,
    as a job a batch runner runs."""
    intake = await take_in(request, ResponseCreateRequest, "resp")
    refuse_unsupported(intake.body)
    if intake.body.store:
        await intake.gateway.responses.check_room(intake.context.tenant)
    if intake.context.session_id is not None:
        raise BadRequest("Sessions are for chat completions: continue with 'previous_response_id'.", param="session")
    # a continuation of a response that is not there is answered 404 whatever the fleet's load
    previous = await previous_response(intake)
    if intake.body.background:
        await prepare_response(intake, previous)  # its 400s now; the job prepares it again
        return await create_in_background(intake)
    async with fleet_place(intake):
        return await _create(intake, previous)


class PreparedResponse(NamedTuple):
    """A checked response request ready to submit, and the turn that reads its output."""

    submission: Submission
    turn: Turn


async def prepare_response(intake: Intake[ResponseCreateRequest], previous: StoredResponse | None) -> PreparedResponse:
    """The request a worker runs for ``intake`` (continuing ``previous``), and its turn; raises the
    request's 400s. A background response's job prepares it again from the same body."""
    body = intake.body
    items = input_items(body)
    conversation = [*(previous.messages if previous is not None else []), *chat_messages(items)]
    parser_name = intake.gateway.settings.tool_call_parser
    tokenizer = intake.model.tokenizer
    tools = await run_off_loop(
        lambda: plan_response_tools(body, conversation, tokenizer, parser_name), inline=body.tools is None
    )
    prompt = await _prompt(intake, items, previous)
    constrained = body.model_copy(update={"response_format": body.chat_response_format()})
    submission = await run_off_loop(
        lambda: _submission(intake, constrained, prompt, tools),
        inline=not compiles_grammar(constrained, tools.grammar),
    )
    reasoning = reasoning_start(
        intake.gateway.settings.reasoning_parser,
        tokenizer.chat_template,
        prompt.text,
        constrained=submission.request.grammar is not None,
    )
    return PreparedResponse(submission, Turn(intake, prompt, items, tools, reasoning))


async def _create(intake: Intake[ResponseCreateRequest], previous: StoredResponse | None) -> Response:
    submission, turn = await prepare_response(intake, previous)
    gateway = intake.gateway
    admitted = gateway.admission.tenant_place(submission.request)
    if not intake.body.stream:
        async with admitted as rate_limits:
            async with start_generation_of(gateway, submission) as generation:
                async for _ in generation.deltas():
                    pass
            reply = generation.choices[0]
            turn.read(reply.text)
            turn.end(reply)
            return JSONResponse(await turn.conclude(reply, generation.usage), headers=rate_limits)
    stack = AsyncExitStack()
    try:
        rate_limits = await stack.enter_async_context(admitted)
        generation = await stack.enter_async_context(start_generation_of(gateway, submission))
        first = await generation.next_delta()
    except BaseException:
        await stack.aclose()
        raise
    response = sse_response(response_events(stack, generation, first, turn), on_close=stack.aclose)
    response.headers.update(rate_limits)
    return response


def _submission(
    intake: Intake[ResponseCreateRequest], body: ResponseCreateRequest, prompt: ResponsePrompt, tools: ToolPlan
) -> Submission:
    """The request a worker runs; ``body``'s ``response_format`` is its ``text.format`` (errors name
    ``text.format``, the Responses field)."""
    try:
        return build_submission(
            body,
            intake.context,
            intake.model,
            prompt_ids=prompt.token_ids,
            budget=body.token_budget,
            logprobs=None,
            prompt_param="input",
            checkpoint_positions=prompt.marks,
            keep_final_state=body.store,  # the seal resumes from it
            tool_grammar=tools.grammar,
            tool_param=tools.grammar_param,
            keeps_special_tokens=tools.tool_format is not None and tools.tool_format.keeps_special_tokens,
        )
    except BadRequest as error:
        if error.param != "response_format":
            raise
        raise BadRequest(error.message.replace("response_format", "text.format"), param="text.format") from None


async def previous_response(intake: Intake[ResponseCreateRequest]) -> StoredResponse | None:
    """The stored response ``previous_response_id`` continues (None without one); 404 or 400 if it
    cannot be continued."""
    previous_id = intake.body.previous_response_id
    if previous_id is None:
        return None
    found = await intake.gateway.responses.get(intake.context.tenant, _response_id(previous_id, "previous_response_id"))
    if found is None:
        raise NotFound(f"Previous response with id {previous_id!r} not found.", param="previous_response_id")
    if isinstance(found, BackgroundResponse):
        raise BadRequest(
            f"Previous response {previous_id!r} is {found.body['status']}: only a completed response can be continued.",
            param="previous_response_id",
        )
    if isinstance(found, UnstoredResponse):
        raise BadRequest(
            f"Previous response {previous_id!r} was created with 'store': false, so the server did not keep it "
            "and it cannot be continued: create responses you want to continue with 'store': true, or send the "
            "whole conversation as input.",
            param="previous_response_id",
        )
    if found.body.get("model") != intake.body.model:
        raise BadRequest(
            f"Previous response {previous_id!r} was made by model {found.body.get('model')!r}: a conversation "
            "continues from its exact tokens, so it must stay on that model.",
            param="model",
        )
    return found


async def _prompt(
    intake: Intake[ResponseCreateRequest], items: list[dict[str, Any]], previous: StoredResponse | None
) -> ResponsePrompt:
    """Long conversations are rendered and encoded in a worker thread, so the event loop keeps serving."""
    size = items_chars(items)
    size += len(previous.rendered) if previous is not None else 0
    work = functools.partial(response_prompt, intake.model.tokenizer, intake.body, items, previous)
    return await asyncio.to_thread(work) if size > INLINE_PROMPT_CHARS else work()


def start_generation_of(gateway: Gateway, submission: Submission, *, attach: bool = False) -> Any:
    """``start_generation`` of ``submission`` on ``gateway``'s relay and dispatcher."""
    return start_generation(
        submission, relay=gateway.relay, dispatcher=gateway.dispatcher, metrics=gateway.metrics, attach=attach
    )


def _response_id(raw: str, param: str = "response_id") -> str:
    try:
        return check_segment(raw, "response id")
    except ValueError:
        raise NotFound(f"Response with id {raw!r} not found.", param=param) from None


async def _found(request: Request, response_id: str) -> tuple[str, StoredResponse | BackgroundResponse]:
    """The tenant asking and its response ``response_id`` (404 if it has none by that id)."""
    gateway = gateway_of(request)
    tenant = gateway.auth.tenant_for(request.headers.get("authorization"))
    found = await gateway.responses.get(tenant, _response_id(response_id))
    if not isinstance(found, StoredResponse | BackgroundResponse):
        raise NotFound(f"Response with id {response_id!r} not found.", param="response_id")
    return tenant, found


async def _stored(request: Request, response_id: str) -> StoredResponse:
    _, found = await _found(request, response_id)
    if not isinstance(found, StoredResponse):
        raise NotFound(f"Response with id {response_id!r} has not completed.", param="response_id")
    return found


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: int | None = Query(None, ge=0),
) -> Response | dict[str, Any]:
    """A stored response, as ``create`` returned it; a background one as far as it got. With
    ``stream``, a background response's events after ``starting_after`` and then the new ones until
    its end."""
    tenant, found = await _found(request, response_id)
    if not stream:
        if starting_after is not None:
            raise BadRequest("'starting_after' is for streaming: send it with 'stream=true'.", param="starting_after")
        return found.body
    if not found.body.get("background"):
        raise BadRequest("Only responses created with 'background': true can be streamed again.", param="stream")
    return stream_events(gateway_of(request), tenant, found.body["id"], starting_after=starting_after)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    """Forget a stored response: it can no longer be retrieved or continued."""
    gateway = gateway_of(request)
    tenant = gateway.auth.tenant_for(request.headers.get("authorization"))
    if not await gateway.responses.delete(tenant, _response_id(response_id)):
        raise NotFound(f"Response with id {response_id!r} not found.", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """The response's input items, newest first unless ``order=asc``; pages after item ``after``."""
    items = list((await _stored(request, response_id)).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise BadRequest(f"No input item {after!r} in response {response_id!r}.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Cancel a background response that is queued or in progress (its fleet request too); the
    response as it is after. A foreground response cannot be: it ran to its end (a stream is
    cancelled by closing it)."""
    tenant, found = await _found(request, response_id)
    if not found.body.get("background"):
        raise BadRequest(
            "Only responses created with 'background': true can be cancelled; this one already ran to its end "
            "(close a stream to cancel a response in progress).",
            param="response_id",
        )
    return await cancel_background(gateway_of(request), tenant, found.body)
