"""Errors a client can be shown, each knowing its HTTP status and OpenAI-style error body."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

RETRYABLE_STATUSES = frozenset({429, 503})
"""Statuses whose responses always carry ``Retry-After``."""


class MetraleError(Exception):
    """Base of every error that reaches a client.

    Subclasses fix ``status`` (HTTP), ``error_type`` and ``code`` (the OpenAI ``type`` and
    ``code`` fields); ``param`` names the offending request field, if any.
    """

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> dict[str, Any]:
        """The response body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    retry_after_s: float = 1.0
    """For a 429 or 503: when to retry, sent as ``Retry-After`` (so OpenAI's client retries by itself)."""

    def headers(self) -> dict[str, str]:
        """Extra HTTP response headers this error calls for: ``Retry-After`` (whole seconds, rounded up,
        at least 1) on every 429 and 503."""
        if self.status in RETRYABLE_STATUSES:
            return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}
        return {}


class BadRequest(MetraleError):
    """The request is malformed or asks for something impossible."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class PromptTooLong(MetraleError):
    """The prompt plus requested tokens exceed the model's context length."""

    status = 400
    error_type = "invalid_request_error"
    code = "context_length_exceeded"

    def __init__(self, limit: int, got: int, *, param: str | None = "messages") -> None:
        super().__init__(
            f"This model's maximum context length is {limit} tokens, but the request needs {got}.",
            param=param,
        )
        self.limit = limit
        self.got = got


class Unauthorized(MetraleError):
    """The API key is missing or unknown."""

    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"

    def __init__(self, message: str = "Missing or invalid API key.") -> None:
        super().__init__(message)


class ModelNotFound(MetraleError):
    """No worker announces the requested model."""

    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model {model!r} does not exist or is not served.", param="model")
        self.model = model


class SessionNotFound(MetraleError):
    """The tenant has no session of that id (never created, expired or deleted)."""

    status = 404
    error_type = "invalid_request_error"
    code = "session_not_found"


class NotFound(MetraleError):
    """The tenant has no file or batch of that id (never created, deleted, or another tenant's)."""

    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class Conflict(MetraleError):
    """The request conflicts with the state of what it names (a file that an unfinished batch reads)."""

    status = 409
    error_type = "invalid_request_error"
    code = "conflict"


class QuotaExceeded(MetraleError):
    """The tenant keeps as much as its storage quota allows; the message names the setting and its value."""

    status = 400
    error_type = "invalid_request_error"
    code = "quota_exceeded"


class PayloadTooLarge(MetraleError):
    """The request body exceeds the gateway's size limit."""

    status = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class InvalidBody(MetraleError):
    """The request body is not JSON or does not match the endpoint's schema (missing or mistyped fields)."""

    status = 422
    error_type = "invalid_request_error"
    code = "invalid_body"


class QueueFull(MetraleError):
    """Too many requests are waiting; the client should retry after ``retry_after_s`` seconds."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"The server is busy; retry in {retry_after_s:g} s.")
        self.retry_after_s = retry_after_s


class TenantLimited(MetraleError):
    """The tenant is over one of its limits (``MET_API_KEYS``); the response carries the
    ``x-ratelimit-*`` headers OpenAI sends, besides ``Retry-After``."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float, rate_limit_headers: Mapping[str, str]) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.rate_limit_headers = dict(rate_limit_headers)

    def headers(self) -> dict[str, str]:
        return {**self.rate_limit_headers, **super().headers()}


class TenantRequestsLimited(TenantLimited):
    """The tenant has its most requests in flight (OpenAI's error type for a request limit)."""

    error_type = "requests"


class TenantTokensLimited(TenantLimited):
    """The tenant used its tokens for the minute (OpenAI's error type for a token limit)."""

    error_type = "tokens"


class WorkerFailed(MetraleError):
    """The fleet took the request but could not run it: its workers were lost too often, or it cannot be
    continued exactly after one was lost, or its worker failed."""

    status = 500
    error_type = "server_error"
    code = "worker_failed"


class NoWorker(MetraleError):
    """The model is known but no live worker serves it."""

    status = 503
    error_type = "server_error"
    code = "no_worker_available"
    retry_after_s = 2.0  # about one heartbeat: a starting or restarted worker is live by then

    def __init__(self, message: str = "No worker is available to serve this request.") -> None:
        super().__init__(message)


class DeadlineExceeded(MetraleError):
    """The request's deadline passed before it finished."""

    status = 504
    error_type = "timeout_error"
    code = "deadline_exceeded"

    def __init__(self, message: str = "The request did not finish before its deadline.") -> None:
        super().__init__(message)
