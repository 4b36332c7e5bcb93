"""The first steps of every generation request, in the order their errors take precedence:
authenticate (401), parse the body (413, 422), check its limits (400), find the model (404, 503),
judge its tenant's limits (429, nothing charged yet); then ``fleet_place`` admits it to the fleet (429)
before any work on its prompt."""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Request

from metrale.gateway.api.prepare.off_loop import run_off_loop
from metrale.gateway.api.prepare.sampling import RequestContext, session_id_of
from metrale.gateway.edge.body import parse_body
from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.generation_defaults import sampling_defaults, with_sampling_defaults
from metrale.gateway.request_bodies import SamplingFields
from metrale.gateway.request_limits import check_request_limits
from metrale.gateway.state import Gateway, gateway_of
from metrale.shared.ids import random_hex
from metrale.shared.messages import Priority

SESSION_HEADER = "X-Session-Id"

Body = TypeVar("Body", bound=SamplingFields)


@dataclass(frozen=True, slots=True)
class Intake(Generic[Body]):
    """An authenticated, parsed request for a live model."""

    gateway: Gateway
    body: Body
    model: ServedModel
    context: RequestContext


async def take_in(request: Request, schema: type[Body], id_prefix: str) -> Intake[Body]:
    """Authenticate ``request``, parse its body as ``schema`` and resolve its model.

    The request id is ``{id_prefix}-{32 random hex digits}``; the deadline is ``request_timeout_s`` from now.
    """
    gateway = gateway_of(request)
    tenant = gateway.auth.tenant_for(request.headers.get("authorization"))
    body = await parse_body(request, schema)
    now = time.time()
    context = RequestContext(
        request_id=f"{id_prefix}-{random_hex()}",
        tenant=tenant,
        session_id=session_id_of(body.session, request.headers.get(SESSION_HEADER)),
        deadline=now + gateway.settings.request_timeout_s,
        created_at=now,
    )
    intake = await intake_for(gateway, body, context)
    # A tenant at its limit is refused now, not after its prompt is rendered: the request asks for at
    # least its output tokens (the prompt's are not known yet) and one place.
    await gateway.admission.tenant_check(tenant, max(1, requested_tokens(body) or 0))
    return intake


async def intake_for(gateway: Gateway, body: Body, context: RequestContext) -> Intake[Body]:
    """An already parsed ``body`` within the request limits (400, ``request_limits.py``; tools and
    schemas are measured off the event loop) for its model (404, 503), e.g. one line of a batch; the
    sampling fields it leaves out take the model's ``generation_config.json`` defaults."""
    schemas = getattr(body, "tools", None) is not None or body.response_format is not None
    await run_off_loop(lambda: check_request_limits(body, gateway.settings.request_limits), inline=not schemas)
    model = await gateway.registry.resolve(body.model)
    body = with_sampling_defaults(body, sampling_defaults(model.announcement.generation_config_json))
    return Intake(gateway, body, model, context)


def fleet_place(intake: Intake[Body]) -> AbstractAsyncContextManager[None]:
    """Admission to the fleet for the block that prepares and delivers ``intake`` (``QueueFull``, 429,
    when it could not start in time): judged before the prompt is rendered or tokenized, counting
    what it asks for (``n × max_tokens``) into the fleet's planned turnover."""
    context = intake.context
    priority = Priority(intake.body.priority)
    tokens = requested_tokens(intake.body)
    return intake.gateway.admission.fleet_place(context.request_id, priority, context.created_at, tokens)


def requested_tokens(body: SamplingFields) -> int | None:
    """What ``body`` asks to generate at most, ``n ×`` its endpoint's token limit (None: no limit set)."""
    budget = getattr(body, "token_budget", None)  # each endpoint's own limit field
    return body.n * budget if isinstance(budget, int) else None
