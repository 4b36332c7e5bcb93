"""Every error the gateway answers, with its exact OpenAI-style error object."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from metrale.gateway.edge.body import MAX_BODY_BYTES
from metrale.shared.messages import Priority
from metrale.shared.record import read_record_async
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MAX_MODEL_LEN, MODEL, counted, encode, eventually, gateway_harness, sse_payloads

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}


def error(message: str, error_type: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None) -> dict[str, Any]:
    return error(message, "invalid_request_error", "invalid_request", param)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        pytest.param({}, "Missing API key: send 'Authorization: Bearer <key>'.", id="no-key"),
        pytest.param({"Authorization": "Bearer sk-wrong"}, "Invalid API key.", id="unknown-key"),
        pytest.param(
            {"Authorization": "Basic sk-good"}, "Missing API key: send 'Authorization: Bearer <key>'.", id="scheme"
        ),
    ],
)
async def test_401_without_a_valid_key(headers: dict[str, str], message: str) -> None:
    async with gateway_harness(api_keys={"sk-good": "acme"}) as h:
        response = await h.http.post(CHAT, json=chat(), headers=headers)
        models = await h.http.get("/v1/models", headers=headers)
    assert response.status_code == 401 and models.status_code == 401
    assert response.json() == error(message, "invalid_request_error", "invalid_api_key")


@pytest.mark.parametrize("model", ["no-such-model", "spaces are not names"], ids=["unknown", "not-a-key-segment"])
async def test_404_for_a_model_no_worker_announced(model: str) -> None:
    async with gateway_harness() as h:
        response = await h.http.post(CHAT, json=chat(model=model))
    assert response.status_code == 404
    assert response.json() == error(
        f"The model {model!r} does not exist or is not served.", "invalid_request_error", "model_not_found", "model"
    )


async def test_404_for_an_unknown_route_is_an_openai_error_too() -> None:
    async with gateway_harness() as h:
        response = await h.http.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json() == bad_request("Not Found", None)


async def test_413_when_content_length_is_over_the_limit() -> None:
    body = json.dumps(chat(pad="x" * MAX_BODY_BYTES)).encode()
    async with gateway_harness() as h:
        response = await h.http.post(CHAT, content=body, headers={"Content-Type": "application/json"})
        assert h.worker.requests == []
    assert response.status_code == 413
    message = f"The request body is {len(body)} bytes; the limit is {MAX_BODY_BYTES} bytes."
    assert response.json() == error(message, "invalid_request_error", "payload_too_large")


async def test_413_when_a_chunked_body_grows_over_the_limit() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny-kimi", "pad": "'
        for _ in range(9):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    async with gateway_harness() as h:
        response = await h.http.post(CHAT, content=chunks())
    assert response.status_code == 413
    message = f"The request body is larger; the limit is {MAX_BODY_BYTES} bytes."
    assert response.json() == error(message, "invalid_request_error", "payload_too_large")


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        pytest.param({"model": MODEL}, "messages: Field required", "messages", id="missing-field"),
        pytest.param(chat(temperature="hot"), "temperature: Input should be a valid number", "temperature", id="type"),
        pytest.param(chat(n=1.5), "n: Input should be a valid integer", "n", id="float-for-int"),
        pytest.param(
            chat(messages=[]),
            "messages: List should have at least 1 item after validation, not 0",
            "messages",
            id="empty-chat",
        ),
        pytest.param(
            chat(priority="urgent"), "priority: Input should be 'interactive' or 'batch'", "priority", id="priority"
        ),
    ],
)
async def test_422_for_a_body_that_does_not_fit_the_schema(body: dict[str, Any], message: str, param: str) -> None:
    async with gateway_harness() as h:
        response = await h.http.post(CHAT, json=body)
    assert response.status_code == 422
    assert response.json() == error(message, "invalid_request_error", "invalid_body", param)


async def test_422_for_a_body_that_is_not_json() -> None:
    async with gateway_harness() as h:
        response = await h.http.post(CHAT, content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    body = response.json()["error"]
    assert body["message"].startswith("body: Invalid JSON")
    assert (body["type"], body["param"], body["code"]) == ("invalid_request_error", None, "invalid_body")


def user_prompt_ids(content: str) -> list[int]:
    """The ChatML rendering of one user turn with the assistant's turn opened."""
    return encode(f"<|bos|><|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")


LONG_CONTENT = "word " * 80


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            chat(messages=[{"role": "user", "content": LONG_CONTENT}]),
            error(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens, but the request needs "
                f"{len(user_prompt_ids(LONG_CONTENT))}.",
                "invalid_request_error",
                "context_length_exceeded",
                "messages",
            ),
            id="prompt-over-context",
        ),
        pytest.param(
            chat(max_tokens=MAX_MODEL_LEN),
            error(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens, but the request needs "
                f"{len(user_prompt_ids('Hi')) + MAX_MODEL_LEN}.",
                "invalid_request_error",
                "context_length_exceeded",
                "max_tokens",
            ),
            id="prompt-plus-max-tokens",
        ),
        pytest.param(
            chat(temperature=-1),
            bad_request("temperature must be finite and in [0, inf), got -1", "temperature"),
            id="temperature",
        ),
        pytest.param(chat(top_p=0), bad_request("top_p must be finite and in (0, 1], got 0", "top_p"), id="top-p"),
        pytest.param(chat(n=0), bad_request("n must be in [1, 128], got 0", "n"), id="n"),
        pytest.param(chat(max_tokens=0), bad_request("max_tokens must be >= 1, got 0", "max_tokens"), id="max-tokens"),
        pytest.param(
            chat(top_logprobs=2),
            bad_request("top_logprobs requires logprobs to be true", "top_logprobs"),
            id="top-logprobs",
        ),
        pytest.param(
            chat(logprobs=True, top_logprobs=21),
            bad_request("top_logprobs must be in [0, 20], got 21", "top_logprobs"),
            id="too-many-logprobs",
        ),
        pytest.param(chat(stop=["ok", ""]), bad_request("stop strings must not be empty", "stop"), id="empty-stop"),
        pytest.param(
            chat(stop_token_ids=[99999]),
            bad_request("stop_token_ids [99999] are outside the vocabulary [0, 517)", "stop_token_ids"),
            id="stop-id",
        ),
        pytest.param(
            chat(messages=[{"role": "robot", "content": "beep"}]),
            bad_request("The chat cannot be rendered with this model's template: Unknown role: robot", "messages"),
            id="template-refuses",
        ),
        pytest.param(
            chat(session="a:b"),
            bad_request(
                "invalid session id 'a:b': use 1-256 characters from A-Z a-z 0-9 . _ - / @ + = "
                "(':' separates Redis key parts)",
                "session",
            ),
            id="session",
        ),
    ],
)
async def test_400_for_bad_values(body: dict[str, Any], expected: dict[str, Any]) -> None:
    async with gateway_harness() as h:
        response = await h.http.post(CHAT, json=body)
        assert h.worker.requests == []
    assert response.status_code == 400
    assert response.json() == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param({"prompt": []}, bad_request("the prompt list is empty", "prompt"), id="empty-list"),
        pytest.param({"prompt": [[]]}, bad_request("the prompt is empty", "prompt"), id="empty-ids"),
        pytest.param(
            {"prompt": [1, 600]},
            bad_request("prompt token ids [600] are outside the vocabulary [0, 517)", "prompt"),
            id="id-outside-vocab",
        ),
        pytest.param(
            {"prompt": "x", "max_tokens": 0},
            bad_request(
                "max_tokens must be >= 1, got 0 (0 is allowed with echo: the prompt alone is answered)", "max_tokens"
            ),
            id="max-tokens-0-without-echo",
        ),
        pytest.param(
            {"prompt": "x", "prompt_logprobs": 1, "stream": True},
            bad_request(
                "prompt_logprobs are not available when stream is true (as in vLLM); use echo with logprobs",
                "prompt_logprobs",
            ),
            id="prompt-logprobs-streamed",
        ),
        pytest.param(
            {"prompt": "x", "prompt_logprobs": 21},
            bad_request("prompt_logprobs must be in [0, 20], got 21", "prompt_logprobs"),
            id="prompt-logprobs-range",
        ),
        pytest.param(
            {"prompt": "x", "logprobs": 30},
            bad_request("logprobs must be in [0, 20], got 30", "logprobs"),
            id="logprobs",
        ),
    ],
)
async def test_400_for_bad_completion_prompts(body: dict[str, Any], expected: dict[str, Any]) -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400
    assert response.json() == expected


async def test_400_when_the_worker_refuses_the_request() -> None:
    script = FakeWorkerScript(lambda request, index: [1, 2], refuse=lambda request: "no state slot fits")
    async with gateway_harness(script) as h:
        response = await h.http.post(CHAT, json=chat())
    assert response.status_code == 400
    assert response.json() == bad_request("The worker refused the request: no state slot fits", None)


async def test_500_when_the_fleet_fails_the_request() -> None:
    reason = "delivered 4 times, more than the 3 allowed (its workers were lost)"
    script = FakeWorkerScript(lambda request, index: [1, 2], fail=lambda request: reason)
    async with gateway_harness(script) as h:
        response = await h.http.post(CHAT, json=chat())
        streamed = await h.http.post(CHAT, json=chat(stream=True))
    assert response.status_code == 500
    assert response.json() == error(f"The request failed on the fleet: {reason}", "server_error", "worker_failed")
    assert streamed.status_code == 500  # nothing was sent yet: the status still says so
    assert streamed.json() == response.json()


async def test_429_with_retry_after_when_the_queue_is_full_counted_in_redis() -> None:
    async with gateway_harness(worker_running=False, max_queue=1) as h:
        for _ in range(2):
            await h.redis.xadd(h.keys.request_stream(Priority.INTERACTIVE), {"msg": b"waiting"})
        response = await h.http.post(CHAT, json=chat())
        refusal_counted = await counted(h, "queue_full_rejections", 1)
    assert response.status_code == 429 and refusal_counted
    assert response.headers["Retry-After"] == "1"
    assert response.json() == error("The server is busy; retry in 1 s.", "rate_limit_error", "rate_limit_exceeded")


@pytest.mark.parametrize(
    ("interactive", "batch", "priority", "refused"),
    [
        pytest.param(0, 5, "interactive", False, id="a-big-batch-does-not-refuse-interactive"),
        pytest.param(2, 5, "interactive", True, id="interactive-entries-refuse-interactive"),
        pytest.param(0, 2, "batch", True, id="a-batch-request-waits-behind-batch-entries"),
        pytest.param(2, 0, "batch", True, id="a-batch-request-waits-behind-interactive-entries"),
        pytest.param(1, 0, "batch", False, id="within-the-bound"),
    ],
)
async def test_the_queue_bound_counts_what_a_request_waits_behind(
    interactive: int, batch: int, priority: str, refused: bool
) -> None:
    async with gateway_harness(worker_running=False, max_queue=1, request_timeout_s=0.3) as h:
        for stream, count in ((Priority.INTERACTIVE, interactive), (Priority.BATCH, batch)):
            for _ in range(count):
                await h.redis.xadd(h.keys.request_stream(stream), {"msg": b"waiting"})
        response = await h.http.post(CHAT, json=chat(priority=priority))
    # not refused: it is queued, and (no worker runs) ends at its deadline
    assert response.status_code == (429 if refused else 504), response.text


async def test_503_at_once_when_no_live_worker_serves_the_model() -> None:
    async with gateway_harness(worker_running=False) as h:
        await h.worker.retire()
        response = await h.http.post(CHAT, json=chat())
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "2"
    message = f"No live worker serves the model {MODEL!r} right now; retry later."
    assert response.json() == error(message, "server_error", "no_worker_available")


async def test_503_when_redis_is_unreachable() -> None:
    async with gateway_harness(worker_running=False) as h:
        h.redis.connection_pool.connection_kwargs["server"].connected = False
        response = await h.http.post(CHAT, json=chat())
        h.redis.connection_pool.connection_kwargs["server"].connected = True
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert response.json() == error(
        "The request queue is unreachable; retry later.", "server_error", "queue_unavailable"
    )


def _deadline_error(request_id: str) -> dict[str, Any]:
    message = f"The request did not finish within its deadline ({request_id})."
    return error(message, "timeout_error", "deadline_exceeded")


async def test_504_at_the_deadline_and_the_worker_is_told_to_stop() -> None:
    script = FakeWorkerScript(lambda request, index: [7] * 60, step_s=0.05)
    async with gateway_harness(script, request_timeout_s=0.3) as h:
        response = await h.http.post(CHAT, json=chat())
        (request,) = h.worker.requests

        async def aborted() -> bool:
            record = await read_record_async(h.redis, request.request_id, keys=h.keys)
            return record is not None and record.finish_reason is not None

        await eventually(aborted)
    assert response.status_code == 504
    assert response.json() == _deadline_error(request.request_id)
    assert [(c.request_id, c.reason) for c in h.worker.cancels] == [(request.request_id, "deadline exceeded")]


async def test_504_for_a_stream_that_got_no_token_before_its_deadline() -> None:
    async with gateway_harness(worker_running=False, request_timeout_s=0.2) as h:
        response = await h.http.post(CHAT, json=chat(stream=True))
        ((_, fields),) = await h.redis.xrange(h.keys.request_stream(Priority.INTERACTIVE))
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert fields[b"msg"]


async def test_a_deadline_after_the_stream_started_ends_it_with_an_error_event() -> None:
    script = FakeWorkerScript(lambda request, index: [7] * 60, step_s=0.05)
    async with gateway_harness(script, request_timeout_s=0.3) as h:
        response = await h.http.post(CHAT, json=chat(stream=True))
        (request,) = h.worker.requests
    assert response.status_code == 200
    chunks = sse_payloads(response.text)
    assert chunks[-1] == _deadline_error(request.request_id)
    assert len(chunks) > 2  # the role chunk and some tokens came first


async def test_every_503_carries_retry_after() -> None:
    async with gateway_harness(worker_running=False) as h:  # no file store either
        await h.worker.retire()
        answers = [
            await h.http.get("/ready"),
            await h.http.post(CHAT, json=chat()),
            await h.http.get("/v1/files"),
            await h.http.post("/v1/batches", json={"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h"}),
        ]
    assert [answer.status_code for answer in answers] == [503] * 4
    assert all(int(answer.headers["Retry-After"]) >= 1 for answer in answers)
