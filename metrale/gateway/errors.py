"""How failures become HTTP responses: always an OpenAI-style error object.

``MetraleError`` s carry their own status and body. FastAPI's request validation errors become 422s,
Starlette's HTTP errors (unknown route, wrong method) keep their status with an OpenAI body, a
Redis outage is a 503 rather than a traceback, and a client gone before its body was read is answered
(to nobody) with 499, nginx's "client closed request", so the access log and ``/metrics`` count it as
what it is, in one line and without a traceback.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import ClusterDownError, ConnectionError, RedisClusterException, TimeoutError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from metrale.gateway.edge.body import invalid_body
from metrale.shared.errors import BadRequest, MetraleError

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client closed the connection before the answer; never sent."""


class RedisUnavailable(MetraleError):
    """The gateway cannot reach Redis, so it can neither queue requests nor hear from workers."""

    status = 503
    error_type = "server_error"
    code = "queue_unavailable"

    def __init__(self) -> None:
        super().__init__("The request queue is unreachable; retry later.")


def error_response(error: MetraleError) -> JSONResponse:
    """The response for ``error``: its status, its OpenAI body and its extra headers."""
    return JSONResponse(error.to_openai(), status_code=error.status, headers=error.headers())


def install_error_handlers(app: FastAPI) -> None:
    """Make every error ``app`` answers an OpenAI-style error object."""

    async def metrale_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, MetraleError)
        return error_response(exc)

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(invalid_body(exc.errors()))

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        body = BadRequest(str(exc.detail)).to_openai()  # the OpenAI body, with Starlette's status
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def redis_unavailable(_: Request, exc: Exception) -> JSONResponse:
        logger.warning("Redis is unreachable: %s", exc)
        return error_response(RedisUnavailable())

    async def client_disconnected(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ClientDisconnect)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    app.add_exception_handler(MetraleError, metrale_error)
    app.add_exception_handler(ClientDisconnect, client_disconnected)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ConnectionError, redis_unavailable)
    app.add_exception_handler(TimeoutError, redis_unavailable)
    app.add_exception_handler(RedisClusterException, redis_unavailable)  # no node of a cluster answers
    app.add_exception_handler(ClusterDownError, redis_unavailable)  # a shard has no primary yet
