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
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response

from metrale.gateway.api.intake import Intake, fleet_place, take_in
from metrale.gateway.api.prompts import INLINE_PROMPT_CHARS
from metrale.gateway.api.sampling import build_submission
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.gateway.responses.conversation import ResponsePrompt, response_prompt
from metrale.gateway.responses.events import response_events
from metrale.gateway.responses.items import input_items
from metrale.gateway.responses.store import StoredResponse, UnstoredResponse
from metrale.gateway.responses.turn import Turn
from metrale.gateway.state import gateway_of
from metrale.gateway.streams.generation import start_generation
from metrale.gateway.streams.streaming import sse_response
from metrale.gateway.streams.submission import Submission
from metrale.shared.errors import BadRequest, NotFound
from metrale.shared.keys import check_segment

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(request: Request) -> Response:
    """Create a response (OpenAI Responses API, text input and output)."""
    intake = await take_in(request, ResponseCreateRequest, "resp")
    intake.body.refuse_unsupported()
    if intake.body.store:
        await intake.gateway.responses.check_room(intake.context.tenant)
    if intake.context.session_id is not None:
        raise BadRequest("Sessions are for chat completions: continue with 'previous_response_id'.", param="session")
    # a continuation of a response that is not there is answered 404 whatever the fleet's load
    previous = await _previous(intake)
    async with fleet_place(intake):
        return await _create(intake, previous)


async def _create(intake: Intake[ResponseCreateRequest], previous: StoredResponse | None) -> Response:
    body = intake.body
    items = input_items(body)
    prompt = await _prompt(intake, items, previous)
    submission = build_submission(
        body,
        intake.context,
        intake.model,
        prompt_ids=prompt.token_ids,
        budget=body.token_budget,
        logprobs=None,
        prompt_param="input",
        checkpoint_positions=prompt.marks,
        keep_final_state=body.store,  # the seal resumes from it
    )
    turn = Turn(intake, prompt, items)
    gateway = intake.gateway
    admitted = gateway.admission.tenant_place(submission.request)
    if not body.stream:
        async with admitted as rate_limits:
            async with _generation(intake, submission) as generation:
                async for _ in generation.deltas():
                    pass
            return JSONResponse(await turn.conclude(generation.choices[0], generation.usage), headers=rate_limits)
    stack = AsyncExitStack()
    try:
        rate_limits = await stack.enter_async_context(admitted)
        generation = await stack.enter_async_context(_generation(intake, submission))
        first = await generation.next_delta()
    except BaseException:
        await stack.aclose()
        raise
    response = sse_response(response_events(stack, generation, first, turn), on_close=stack.aclose)
    response.headers.update(rate_limits)
    return response


async def _previous(intake: Intake[ResponseCreateRequest]) -> StoredResponse | None:
    previous_id = intake.body.previous_response_id
    if previous_id is None:
        return None
    found = await intake.gateway.responses.get(intake.context.tenant, _response_id(previous_id, "previous_response_id"))
    if found is None:
        raise NotFound(f"Previous response with id {previous_id!r} not found.", param="previous_response_id")
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
    size = sum(len(part["text"]) for item in items for part in item["content"])
    size += len(previous.rendered) if previous is not None else 0
    work = functools.partial(response_prompt, intake.model.tokenizer, intake.body, items, previous)
    return await asyncio.to_thread(work) if size > INLINE_PROMPT_CHARS else work()


def _generation(intake: Intake[ResponseCreateRequest], submission: Submission) -> Any:
    gateway = intake.gateway
    return start_generation(submission, relay=gateway.relay, dispatcher=gateway.dispatcher, metrics=gateway.metrics)


def _response_id(raw: str, param: str = "response_id") -> str:
    try:
        return check_segment(raw, "response id")
    except ValueError:
        raise NotFound(f"Response with id {raw!r} not found.", param=param) from None


async def _stored(request: Request, response_id: str) -> StoredResponse:
    gateway = gateway_of(request)
    tenant = gateway.auth.tenant_for(request.headers.get("authorization"))
    found = await gateway.responses.get(tenant, _response_id(response_id))
    if not isinstance(found, StoredResponse):
        raise NotFound(f"Response with id {response_id!r} not found.", param="response_id")
    return found


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response, as ``create`` returned it."""
    return (await _stored(request, response_id)).body


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
    """Only background responses can be cancelled; Metrale runs every response in the foreground (a
    streamed one is cancelled by closing its stream)."""
    await _stored(request, response_id)
    raise BadRequest(
        "Only responses created with 'background': true can be cancelled; this one already ran to its end "
        "(close a stream to cancel a response in progress).",
        param="response_id",
    )
