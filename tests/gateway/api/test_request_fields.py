"""Every field of OpenAI's chat and completion requests is honoured or refused by name (never ignored)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.harness import MODEL, gateway_harness

pytestmark = pytest.mark.anyio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there."}]}
COMPLETION = {"model": MODEL, "prompt": "Numbers mattered in her work."}


async def _post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], list[Any]]:
    async with gateway_harness() as h:
        response = await h.http.post(path, json=body)
        return response.status_code, response.json(), list(h.worker.requests)


async def test_logit_bias_reaches_the_worker_as_pairs() -> None:
    status, _, requests = await _post("/v1/completions", {**COMPLETION, "logit_bias": {"17": 100, "5": -2.5}})
    assert status == 200
    (request,) = requests
    assert request.logit_bias == [(17, 100.0), (5, -2.5)]


@pytest.mark.parametrize(
    ("logit_bias", "message"),
    [
        pytest.param({"999999": 1.0}, "not a token id in the vocabulary", id="out-of-vocab"),
        pytest.param({"-1": 1.0}, "not a token id", id="negative"),
        pytest.param({"abc": 1.0}, "not a token id", id="not-a-number"),
        pytest.param({"3": 100.5}, "[-100, 100]", id="too-large"),
        pytest.param({str(i): 1.0 for i in range(301)}, "at most 300", id="too-many"),
        pytest.param({"3": 1.0, "03": 2.0}, "more than once", id="same-token-twice"),
    ],
)
async def test_bad_logit_bias_is_a_400(logit_bias: dict[str, float], message: str) -> None:
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        status, answer, requests = await _post(path, {**body, "logit_bias": logit_bias})
        assert status == 400, answer
        assert answer["error"]["param"] == "logit_bias" and message in answer["error"]["message"]
        assert requests == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("best_of", 3),
        ("suffix", " and then"),
    ],
)
async def test_completion_fields_metrale_cannot_honour_are_400s(field: str, value: Any) -> None:
    status, answer, requests = await _post("/v1/completions", {**COMPLETION, "n": 1, field: value})
    assert status == 400 and answer["error"]["param"] == field
    assert requests == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("best_of", 2), ("suffix", ""), ("suffix", None), ("user", "u-1")],
)
async def test_completion_fields_that_ask_for_nothing_more_are_accepted(field: str, value: Any) -> None:
    status, answer, _ = await _post("/v1/completions", {**COMPLETION, "n": 2, field: value})
    assert status == 200, answer


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("metadata", {"k": "v"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("prompt_cache_key", "k"),
        ("reasoning_effort", "low"),
        ("service_tier", "flex"),
        ("store", True),
        ("verbosity", "low"),
        ("web_search_options", {}),
    ],
)
async def test_chat_fields_metrale_cannot_honour_are_400s(field: str, value: Any) -> None:
    status, answer, requests = await _post("/v1/chat/completions", {**CHAT, field: value})
    assert status == 400 and answer["error"]["param"] == field, answer
    assert requests == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store", False),
        ("modalities", ["text"]),
        ("service_tier", "auto"),
        ("service_tier", "default"),
        ("user", "u-1"),
        ("safety_identifier", "hash-1"),
        ("metadata", None),
    ],
)
async def test_chat_fields_that_ask_for_nothing_more_are_accepted(field: str, value: Any) -> None:
    status, answer, _ = await _post("/v1/chat/completions", {**CHAT, field: value})
    assert status == 200, answer


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_an_unknown_field_is_a_400_naming_it(path: str) -> None:
    body = CHAT if path == "/v1/chat/completions" else COMPLETION
    status, answer, requests = await _post(path, {**body, "temprature": 0.2})
    assert status == 400
    assert answer["error"]["param"] == "temprature" and "Unrecognized" in answer["error"]["message"]
    assert requests == []


async def test_an_unknown_stream_option_is_a_400_naming_it() -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "colour": 1}}
    status, answer, _ = await _post("/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "stream_options.colour"
    body["stream_options"] = {"include_obfuscation": True}
    status, answer, _ = await _post("/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "stream_options"
