"""``background: true`` responses at the HTTP edge: create one (kept in Redis as ``queued``, its job on
the responses queue of the batch runners), stream its events again from any gateway, cancel it.

The gateway only writes the response's record and its opening events (``response.created``,
``response.queued``) and enqueues the job; the job (``metrale/batch/background_response.py``) runs
it on the fleet and appends the rest. So neither a client leaving nor the gateway restarting stops it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import JSONResponse, Response

from metrale.gateway.api.prepare.intake import Intake
from metrale.gateway.responses.background_events import follow_events
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.gateway.responses.objects import response_json
from metrale.gateway.responses.output import OutputEvent
from metrale.gateway.state import Gateway
from metrale.gateway.streams.streaming import sse_response
from metrale.shared.errors import BadRequest

CANCEL_REASON = "response cancelled"


async def create_in_background(intake: Intake[ResponseCreateRequest]) -> Response:
    """Keep the (checked) response ``queued`` and enqueue its job; answer its object, or with
    ``stream`` its events as the job appends them (the response runs on if the client leaves)."""
    gateway, context = intake.gateway, intake.context
    jobs = gateway.batch_jobs
    if jobs is None:
        raise BadRequest("This gateway has no job queue, so it cannot run background responses.", param="background")
    queued = response_json(
        response_id=context.request_id, created_at=int(context.created_at), body=intake.body, status="queued", output=[]
    )
    opening = [OutputEvent(kind, {"response": queued}) for kind in ("response.created", "response.queued")]
    await gateway.background.create(
        context.tenant,
        queued,
        request_json=intake.body.model_dump_json(exclude_unset=True, by_alias=True),
        created_at=context.created_at,
        deadline=float(context.deadline if context.deadline is not None else 0.0),
        events=opening,
    )
    await asyncio.to_thread(jobs.enqueue_response, context.tenant, context.request_id)
    if intake.body.stream:
        return stream_events(gateway, context.tenant, context.request_id, starting_after=None)
    return JSONResponse(queued)


def stream_events(gateway: Gateway, tenant: str, response_id: str, *, starting_after: int | None) -> Response:
    """The response's events after ``starting_after`` (None: all), then the new ones until its end."""
    after = starting_after if starting_after is not None else -1
    return sse_response(follow_events(gateway.background, tenant, response_id, after), on_close=_nothing)


async def cancel_background(gateway: Gateway, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
    """Cancel a background response (``body``, as last read) unless it has ended; the response as it
    is after (cancelling again, or after its end, changes nothing and answers the same)."""
    response_id = body["id"]
    if await gateway.background.cancel(tenant, response_id):
        await gateway.dispatcher.cancel(response_id, CANCEL_REASON)  # a job not started yet finds it cancelled
    found = await gateway.responses.get(tenant, response_id)
    return found.body if found is not None and hasattr(found, "body") else body


async def _nothing() -> None:
    return None
