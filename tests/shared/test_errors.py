from __future__ import annotations

import pytest

from metrale.shared.errors import (
    BadRequest,
    DeadlineExceeded,
    InvalidBody,
    MetraleError,
    ModelNotFound,
    NoWorker,
    PayloadTooLarge,
    PromptTooLong,
    QueueFull,
    Unauthorized,
)

CASES = {
    "model-not-found": (ModelNotFound("kimi-xl"), 404, "invalid_request_error", "model_not_found", "model"),
    "prompt-too-long": (
        PromptTooLong(limit=4096, got=5000),
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
    ),
    "queue-full": (QueueFull(retry_after_s=2.5), 429, "rate_limit_error", "rate_limit_exceeded", None),
    "no-worker": (NoWorker(), 503, "server_error", "no_worker_available", None),
    "deadline": (DeadlineExceeded(), 504, "timeout_error", "deadline_exceeded", None),
    "unauthorized": (Unauthorized(), 401, "invalid_request_error", "invalid_api_key", None),
    "bad-request": (
        BadRequest("n must be >= 1", param="n"),
        400,
        "invalid_request_error",
        "invalid_request",
        "n",
    ),
    "invalid-body": (
        InvalidBody("messages: Field required", param="messages"),
        422,
        "invalid_request_error",
        "invalid_body",
        "messages",
    ),
    "too-large": (
        PayloadTooLarge("body over 1 MiB"),
        413,
        "invalid_request_error",
        "payload_too_large",
        None,
    ),
}


@pytest.mark.parametrize(("error", "status", "error_type", "code", "param"), list(CASES.values()), ids=list(CASES))
def test_each_error_knows_its_status_and_openai_body(
    error: MetraleError, status: int, error_type: str, code: str, param: str | None
) -> None:
    assert isinstance(error, MetraleError)
    assert error.status == status
    body = error.to_openai()
    assert body == {"error": {"message": str(error), "type": error_type, "param": param, "code": code}}
    assert body["error"]["message"]


def test_messages_carry_the_numbers_a_client_needs() -> None:
    too_long = PromptTooLong(limit=4096, got=5000)
    assert (too_long.limit, too_long.got) == (4096, 5000)
    assert "4096" in too_long.message and "5000" in too_long.message
    assert "kimi-xl" in ModelNotFound("kimi-xl").message


@pytest.mark.parametrize(
    ("retry_after_s", "header"),
    [
        pytest.param(2.5, "3", id="rounds-up"),
        pytest.param(4.0, "4", id="whole"),
        pytest.param(0.01, "1", id="at-least-one"),
    ],
)
def test_queue_full_tells_when_to_retry(retry_after_s: float, header: str) -> None:
    assert QueueFull(retry_after_s).headers() == {"Retry-After": header}


def test_every_503_says_when_to_retry_and_other_errors_add_no_headers() -> None:
    assert NoWorker().headers() == {"Retry-After": "2"}
    for error in (BadRequest("x"), Unauthorized(), ModelNotFound("m"), DeadlineExceeded(), InvalidBody("x")):
        assert error.headers() == {}


def test_errors_can_be_caught_as_metrale_errors() -> None:
    with pytest.raises(MetraleError) as caught:
        raise QueueFull(1.0)
    assert caught.value.status == 429
