"""One batch line through the gateway's own request handling: the same schema, checks, prompt and
renderer as the online endpoint (``prepare_chat`` / ``prepare_completion``), at priority ``batch``.

A line's request id is fixed by its batch and line number, so a runner that took over a batch finds
the lines its predecessor left running (their run records) and follows them instead of starting them
again. The output line is OpenAI's: ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``, the body exactly what the endpoint would have answered.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from metrale.batch.input_lines import BatchLine
from metrale.gateway.api.chat import prepare_chat
from metrale.gateway.api.completions import prepare_completion
from metrale.gateway.api.prepare.intake import Intake, intake_for
from metrale.gateway.api.prepare.sampling import RequestContext, session_id_of
from metrale.gateway.batches.objects import Batch
from metrale.gateway.edge.body import invalid_body
from metrale.gateway.request_bodies import ChatCompletionRequest, CompletionRequest, SamplingFields
from metrale.gateway.state import Gateway
from metrale.gateway.streams.delivery import Prepared, answer_whole
from metrale.shared.errors import MetraleError
from metrale.shared.messages import Priority

DEFAULT_WINDOW_S = 24 * 3600


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How one endpoint reads and prepares a body."""

    schema: type[SamplingFields]
    id_prefix: str
    prepare: Callable[[Intake[Any]], Awaitable[Prepared]]


ENDPOINTS = {
    "/v1/chat/completions": Endpoint(ChatCompletionRequest, "chatcmpl", prepare_chat),
    "/v1/completions": Endpoint(CompletionRequest, "cmpl", prepare_completion),
}


def line_request_id(batch: Batch, line: BatchLine) -> str:
    """The request id of a line: the same for every runner that takes the batch."""
    return f"{ENDPOINTS[batch.endpoint].id_prefix}-{batch.id}-{line.number}"


async def prepare_line(gateway: Gateway, tenant: str, batch: Batch, line: BatchLine) -> Prepared:
    """The line checked as its endpoint checks a request, ready to submit; raises ``MetraleError``."""
    endpoint = ENDPOINTS[batch.endpoint]
    try:
        body = endpoint.schema.model_validate_json(line.body_json)
    except ValidationError as error:
        raise invalid_body(error.errors(include_url=False)) from None
    body = body.model_copy(update={"priority": Priority.BATCH.value})
    context = RequestContext(
        request_id=line_request_id(batch, line),
        tenant=tenant,
        session_id=session_id_of(body.session, None),
        deadline=float(batch.expires_at if batch.expires_at is not None else time.time() + DEFAULT_WINDOW_S),
        created_at=time.time(),
    )
    return await endpoint.prepare(await intake_for(gateway, body, context))


async def run_line(gateway: Gateway, tenant: str, batch: Batch, line: BatchLine, *, attach: bool) -> tuple[str, bool]:
    """Run the line (or, with ``attach``, follow it if an earlier runner started it); its output line and
    whether it was answered 200."""
    try:
        body = await answer_whole(gateway, await prepare_line(gateway, tenant, batch, line), attach=attach)
        status = 200
    except MetraleError as error:
        body, status = error.to_openai(), error.status
    return output_line(batch, line, status=status, body=body), status == 200


def output_line(batch: Batch, line: BatchLine, *, status: int, body: dict[str, Any]) -> str:
    """A line of the output (or error) file for an answered request."""
    response = {"status_code": status, "request_id": line_request_id(batch, line), "body": body}
    return json.dumps({"id": _line_id(batch, line), "custom_id": line.custom_id, "response": response, "error": None})


def unanswered_line(batch: Batch, line: BatchLine, *, code: str, message: str) -> str:
    """A line of the error file for a request that never ran (``batch_expired``, ``batch_cancelled``)."""
    error = {"code": code, "message": message}
    return json.dumps({"id": _line_id(batch, line), "custom_id": line.custom_id, "response": None, "error": error})


def _line_id(batch: Batch, line: BatchLine) -> str:
    return f"batch_req_{batch.id.removeprefix('batch_')}_{line.number}"
