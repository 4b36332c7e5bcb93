"""Request bodies: a size limit enforced before parsing, then JSON parsed into a schema.

``BodySizeLimit`` is ASGI middleware: a ``Content-Length`` over the limit is answered with a 413 before
any byte of the body is read; a body sent without one (chunked) is counted as it is read and fails the
same way once it passes the limit. ``parse_body`` turns a body into its pydantic model or an
OpenAI-style 422.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrale.gateway.edge.body_precheck import INLINE_NODES, node_bound
from metrale.gateway.state import gateway_of
from metrale.shared.errors import BadRequest, InvalidBody, MetraleError, PayloadTooLarge

MAX_BODY_BYTES = 8 * 1024 * 1024
"""8 MiB: room for a prompt of a few million characters."""

_MAX_REPORTED_ERRORS = 3

Schema = TypeVar("Schema", bound=BaseModel)


class BodySizeLimit:
    """Refuses request bodies larger than ``max_bytes`` with a 413; ``path_limits`` set other limits for
    some paths (uploads)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, path_limits: Mapping[str, int] | None = None
    ) -> None:
        self._app = app
        self._max_bytes = max_bytes
        self._path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self._path_limits.get(scope.get("path", ""), self._max_bytes)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            error = self._too_large(f"The request body is {declared} bytes", limit)
            await JSONResponse(error.to_openai(), status_code=error.status)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self._too_large("The request body is larger", limit)
            return message

        await self._app(scope, counting_receive, send)

    def _too_large(self, what: str, limit: int) -> PayloadTooLarge:
        return PayloadTooLarge(f"{what}; the limit is {limit} bytes.")


async def parse_body(request: Request, schema: type[Schema]) -> Schema:
    """The JSON body of ``request`` as ``schema``; raises ``InvalidBody`` (422) naming the first bad field,
    or ``BadRequest`` (400) naming the fields no schema declares. A body of many JSON values is judged
    in the pre-check process first (``body_precheck.py``), so one that a limit refuses is never parsed here."""
    raw = await request.body()
    if node_bound(raw) > INLINE_NODES:  # judged elsewhere first: parsing it here could hold the event loop
        gateway = gateway_of(request)
        await gateway.precheck.judge(raw, schema, gateway.settings.request_limits)
    try:
        return schema.model_validate_json(raw)
    except ValidationError as error:
        raise invalid_body(error.errors(include_url=False)) from None


def invalid_body(problems: Sequence[Mapping[str, Any]]) -> MetraleError:
    """An OpenAI-style 422 listing the first few ``problems`` (pydantic's error dicts); a field no schema
    declares is a 400 naming it instead (as OpenAI answers), so nothing sent is silently ignored."""
    unrecognized = [_location(p["loc"]) for p in problems if p["type"] == "extra_forbidden"]
    if unrecognized:
        return BadRequest(f"Unrecognized request argument supplied: {', '.join(unrecognized)}", param=unrecognized[0])
    descriptions = [f"{_location(p['loc']) or 'body'}: {p['msg']}" for p in problems[:_MAX_REPORTED_ERRORS]]
    if len(problems) > _MAX_REPORTED_ERRORS:
        descriptions.append(f"and {len(problems) - _MAX_REPORTED_ERRORS} more")
    first_location = problems[0]["loc"]
    return InvalidBody("; ".join(descriptions), param=str(first_location[0]) if first_location else None)


def _location(loc: Sequence[int | str]) -> str:
    """``("messages", 0, "role")`` as ``messages[0].role``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
