"""The gateway's OpenAPI document, describing what the routes really read and answer.

Routes parse their bodies themselves (authentication comes first, then the body: ``intake.py``), so
FastAPI cannot see the bodies; ``describe_api`` adds each one from its pydantic model, and replaces
FastAPI's default error responses with the OpenAI error object every error really is, under each
status an operation can answer. ``tests/gateway/test_openapi_fuzz.py`` holds the app to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from metrale.gateway.api.batches import CreateBatchRequest
from metrale.gateway.api.tokenize import DetokenizeRequest, TokenizeRequest
from metrale.gateway.request_bodies import ChatCompletionRequest, CompletionRequest
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.shared.errors import RETRYABLE_STATUSES

JSON_BODIES: Mapping[tuple[str, str], type[BaseModel]] = {
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/batches", "post"): CreateBatchRequest,
    ("/v1/responses", "post"): ResponseCreateRequest,
    ("/tokenize", "post"): TokenizeRequest,
    ("/detokenize", "post"): DetokenizeRequest,
}
"""The JSON request body of each operation that takes one."""

UPLOAD_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": ["batch"]},
    },
}
"""``POST /v1/files``: a multipart form with the file and its purpose."""

STREAMED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
"""Operations that answer ``text/event-stream`` when the body asks to stream."""

OTHER_CONTENT: Mapping[tuple[str, str], str] = {
    ("/metrics", "get"): "text/plain",
    ("/v1/files/{file_id}/content", "get"): "application/octet-stream",
}
"""Operations whose 200 is not JSON, and the media type it is."""

SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk object as JSON, or [DONE] last"}},
}
"""One server-sent event of a stream."""

ERRORS_EVERYWHERE = (401, 503)
"""Every ``/v1`` operation checks the API key, and answers 503 while Redis is unreachable."""

ERRORS_BY_PATH: Mapping[str, tuple[int, ...]] = {
    "/v1/chat/completions": (400, 404, 413, 422, 429, 500, 504),
    "/v1/completions": (400, 404, 413, 422, 429, 500, 504),
    "/v1/files": (400, 413, 422),
    "/v1/files/{file_id}": (404, 422),
    "/v1/files/{file_id}/content": (404, 422),
    "/v1/batches": (400, 413, 422),
    "/v1/batches/{batch_id}": (404, 422),
    "/v1/batches/{batch_id}/cancel": (400, 404, 422),
    "/v1/models": (),
    "/v1/models/{model_id}": (404, 422),
    "/v1/sessions/{session_id}": (400, 404, 422),
    "/v1/responses": (400, 404, 413, 422, 429, 500, 504),
    "/v1/responses/{response_id}": (404, 422),
    "/v1/responses/{response_id}/input_items": (400, 404, 422),
    "/v1/responses/{response_id}/cancel": (400, 404, 422),
    "/ready": (503,),
    "/tokenize": (400, 401, 404, 413, 422, 503),
    "/detokenize": (400, 401, 404, 413, 422, 503),
}
"""The error statuses each path answers besides ``ERRORS_EVERYWHERE`` (``/v1`` paths only)."""

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
"""The OpenAI error object every error response carries."""

RETRY_AFTER_HEADER: dict[str, Any] = {
    "description": "Seconds to wait before retrying (OpenAI's client honours it).",
    "required": True,
    "schema": {"type": "integer", "minimum": 1},
}

RATE_LIMIT_HEADERS: dict[str, dict[str, Any]] = {
    f"x-ratelimit-{name}": {"description": description, "schema": {"type": kind}}
    for name, description, kind in (
        ("limit-requests", "The tenant's most requests in flight at once.", "integer"),
        ("remaining-requests", "How many more it may have in flight now.", "integer"),
        ("reset-requests", "When one more may start (e.g. 0ms, 1s).", "string"),
        ("limit-tokens", "The tenant's tokens per minute (prompt plus requested output).", "integer"),
        ("remaining-tokens", "Tokens left in the sliding minute.", "integer"),
        ("reset-tokens", "When the tokens used are all back (on a 429: when this request fits), e.g. 1m30s.", "string"),
    )
}
"""Sent by generation routes to a tenant with limits (``MET_API_KEYS``), as OpenAI sends them: on the
answer and on a 429. The ``requests`` ones only when it has a concurrency limit, the ``tokens`` ones
only when it has a tokens-per-minute limit."""

_REF_TEMPLATE = "#/components/schemas/{model}"


def describe_api(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the document with the real request bodies and error responses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = _with_bodies_and_errors(document)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _with_bodies_and_errors(document: dict[str, Any]) -> dict[str, Any]:
    schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["Error"] = ERROR_SCHEMA
    for (path, method), model in JSON_BODIES.items():
        model_schema = model.model_json_schema(ref_template=_REF_TEMPLATE)
        schemas.update(model_schema.pop("$defs", {}))
        schemas[model.__name__] = model_schema
        operation = document["paths"][path][method]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF_TEMPLATE.format(model=model.__name__)}}},
        }
    document["paths"]["/v1/files"]["post"]["requestBody"] = {
        "required": True,
        "content": {"multipart/form-data": {"schema": UPLOAD_BODY}},
    }
    for path, operations in document["paths"].items():
        for operation in operations.values():
            _document_errors(path, operation)
    for (path, method), media_type in OTHER_CONTENT.items():
        document["paths"][path][method]["responses"]["200"]["content"] = {media_type: {"schema": {"type": "string"}}}
    for path in STREAMED:
        responses = document["paths"][path]["post"]["responses"]
        ok = responses["200"]
        ok["content"] = {**ok.get("content", {}), "text/event-stream": {"schema": SSE_EVENT_SCHEMA}}
        ok["headers"] = dict(RATE_LIMIT_HEADERS)
        responses["429"]["headers"] = {**responses["429"]["headers"], **RATE_LIMIT_HEADERS}
    return document


def _document_errors(path: str, operation: dict[str, Any]) -> None:
    responses: dict[str, Any] = operation["responses"]
    responses.pop("422", None)  # FastAPI's own validation body; ours is the OpenAI error object
    statuses = ERRORS_BY_PATH.get(path, ())
    if path.startswith("/v1"):
        statuses = (*ERRORS_EVERYWHERE, *statuses)
    for status in sorted(set(statuses)):
        responses[str(status)] = {
            "description": _DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        if status in RETRYABLE_STATUSES:
            responses[str(status)]["headers"] = {"Retry-After": RETRY_AFTER_HEADER}


_DESCRIPTIONS = {
    400: "The request asks for something invalid or unsupported (the error names the field).",
    401: "Missing or unknown API key.",
    404: "No such model, session, file, batch or response.",
    413: "The request body is too large.",
    422: "The body is not valid JSON of the request's schema.",
    429: "The fleet could not start the request within MET_MAX_QUEUE_WAIT_S, too many requests wait, or the "
    "tenant is over one of its limits; retry after Retry-After seconds.",
    500: "The fleet failed to run the request.",
    503: "Redis or every worker is unreachable.",
    504: "The request ran past its deadline.",
}
