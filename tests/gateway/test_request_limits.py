"""Request limits: every bound refused with a 400 naming its parameter and its limit, before any work."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from metrale.gateway.request_bodies import ChatCompletionRequest, CompletionRequest, SamplingFields
from metrale.gateway.request_limits import check_request_limits, measure_json
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.shared.errors import BadRequest
from metrale.shared.settings import RequestLimits, load_settings
from tests.gateway.harness import MODEL, gateway_harness

LIMITS = RequestLimits()
USER = [{"role": "user", "content": "Hi."}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": USER, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, "prompt": "Hi.", **fields})


def response(**fields: Any) -> ResponseCreateRequest:
    return ResponseCreateRequest.model_validate({"model": MODEL, "input": "Hi.", **fields})


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def enum_schema(values: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"pick": {"enum": [f"v{i}" for i in range(values)]}}}


REFUSED = {
    "stop-count": (chat(stop=[f"s{i}" for i in range(33)]), "stop", "MET_MAX_STOP_STRINGS"),
    "stop-length": (completion(stop=["x" * 513]), "stop", "MET_MAX_STOP_STRING_CHARS"),
    "stop-token-ids": (completion(stop_token_ids=list(range(257))), "stop_token_ids", "MET_MAX_STOP_TOKEN_IDS"),
    "logit-bias": (chat(logit_bias={str(i): 1.0 for i in range(301)}), "logit_bias", "at most 300"),
    "tools-count": (chat(tools=[tool(f"f{i}") for i in range(129)]), "tools", "MET_MAX_TOOLS"),
    "tool-bytes": (chat(tools=[tool("f", {"type": "object", "description": "d" * 33_000})]), "tools", "tools[0]"),
    "tool-enum": (chat(tools=[tool("f", enum_schema(1001))]), "tools", "MET_MAX_SCHEMA_ENUM_VALUES"),
    "schema-bytes": (
        completion(response_format=schema_format({"type": "string", "description": "d" * 70_000})),
        "response_format",
        "MET_MAX_SCHEMA_BYTES",
    ),
    "schema-enum": (chat(response_format=schema_format(enum_schema(1001))), "response_format", "1001 enum values"),
    "messages": (chat(messages=USER * 2049), "messages", "MET_MAX_MESSAGES"),
    "response-input": (response(input=[{"role": "user", "content": "x"}] * 2049), "input", "MET_MAX_MESSAGES"),
    "chat-work": (
        chat(n=128, logprobs=True, top_logprobs=20, max_tokens=600),
        "max_tokens",
        "MET_MAX_REQUEST_WORK",
    ),
    "chat-work-completion-tokens": (
        chat(n=64, max_completion_tokens=20_000),
        "max_completion_tokens",
        "1280000 token slots",
    ),
    "completion-work": (completion(n=16, logprobs=5, max_tokens=20_000), "max_tokens", "MET_MAX_REQUEST_WORK"),
    "response-work": (response(max_output_tokens=2_000_000), "max_output_tokens", "MET_MAX_REQUEST_WORK"),
    "two-budgets": (chat(max_tokens=10, max_completion_tokens=20), "max_tokens", "max_completion_tokens"),
}


@pytest.mark.parametrize(("body", "param", "named"), REFUSED.values(), ids=REFUSED.keys())
def test_a_body_past_a_limit_is_refused_naming_it(body: SamplingFields, param: str, named: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_request_limits(body, LIMITS)
    assert refused.value.param == param
    assert named in str(refused.value)


ALLOWED = {
    "stops-at-the-limit": chat(stop=["x" * 512] * 32),
    "tools-at-the-limit": chat(tools=[tool(f"f{i}", enum_schema(1000)) for i in range(128)]),
    "schema-enum-at-the-limit": chat(response_format=schema_format(enum_schema(1000))),
    "ordinary-logprobs": chat(n=8, logprobs=True, top_logprobs=20, max_tokens=4096),
    "no-budget": chat(n=128, logprobs=True, top_logprobs=20),
    "equal-budgets": chat(max_tokens=10, max_completion_tokens=10),
    "completion-work-at-the-limit": completion(n=16, logprobs=3, max_tokens=2**14),
}


@pytest.mark.parametrize("body", ALLOWED.values(), ids=ALLOWED.keys())
def test_a_body_within_the_limits_passes(body: SamplingFields) -> None:
    check_request_limits(body, LIMITS)


def test_the_limits_are_settable() -> None:
    tight = RequestLimits(max_stop_strings=1, max_tools=1, max_request_work=100)
    with pytest.raises(BadRequest, match="at most 1 \\(MET_MAX_STOP_STRINGS\\)"):
        check_request_limits(chat(stop=["a", "b"]), tight)
    with pytest.raises(BadRequest, match="the limit is 100 \\(MET_MAX_REQUEST_WORK\\)"):
        check_request_limits(completion(max_tokens=101), tight)
    check_request_limits(completion(max_tokens=100), tight)


def test_the_limits_come_from_met_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_MAX_TOOLS", "7")
    monkeypatch.setenv("MET_MAX_REQUEST_WORK", "5000")
    limits = load_settings().gateway().request_limits
    assert (limits.max_tools, limits.max_request_work, limits.max_stop_strings) == (7, 5000, 32)


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tools"):
        RequestLimits(max_tools=0)


@pytest.mark.parametrize(
    "value",
    [
        {"type": "object", "properties": {"a": {"enum": ["x", "y", 3, None, True]}, "b": [1.5, {}]}},
        [],
        "plain",
        {"nested": [[[["deep"]]]], "n": -12},
    ],
)
def test_measured_json_size_is_the_compact_json_length_give_or_take_a_comma(value: Any) -> None:
    exact = len(json.dumps(value, separators=(",", ":")))
    size = measure_json(value, stop_after=10**6)
    assert exact <= size.chars <= exact + 2 + exact // 4


def test_the_measure_counts_enum_values_everywhere() -> None:
    schema = {"anyOf": [enum_schema(3), {"items": {"enum": [1, 2]}}]}
    assert measure_json(schema, stop_after=10**6).enum_values == 5


def test_the_measure_stops_at_its_limit() -> None:
    """A 4-million-item list is measured as far as the limit (generous bound for a loaded machine)."""
    huge = {"enum": list(range(4_000_000))}
    start = time.perf_counter()
    size = measure_json(huge, stop_after=1000)
    assert time.perf_counter() - start < 0.5
    assert size.chars > 1000


HTTP_REFUSALS = [
    pytest.param("/v1/chat/completions", {"messages": USER, "stop": ["s"] * 33}, "stop", id="chat-stop"),
    pytest.param("/v1/completions", {"prompt": "Hi.", "stop": ["s"] * 33}, "stop", id="completion-stop"),
    pytest.param(
        "/v1/chat/completions",
        {"messages": USER, "tools": [tool(f"f{i}") for i in range(129)]},
        "tools",
        id="chat-tools",
    ),
    pytest.param(
        "/v1/chat/completions", {"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens", id="two"
    ),
    pytest.param("/v1/responses", {"input": "Hi.", "stop_token_ids": [1] * 257}, "stop_token_ids", id="responses"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body", "param"), HTTP_REFUSALS)
async def test_routes_refuse_before_the_model_is_even_looked_up(path: str, body: dict[str, Any], param: str) -> None:
    """An unknown model would be a 404: the limits come first, and nothing reaches a worker."""
    async with gateway_harness() as h:
        answer = await h.http.post(path, json={"model": "no-such-model", **body})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param
        assert h.worker.requests == []


@pytest.mark.anyio
async def test_without_max_tokens_the_work_counts_what_the_context_leaves() -> None:
    """The harness model has 64 tokens of context: three chat choices of what a short prompt leaves
    pass ``max_request_work`` 120 only with ``max_tokens`` set (a completion's default is 16 tokens)."""
    limits = RequestLimits(max_request_work=120)
    async with gateway_harness(request_limits=limits) as h:
        unbounded = await h.http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "n": 3})
        chat = {"model": MODEL, "messages": USER, "n": 3, "max_completion_tokens": 8}
        bounded = await h.http.post("/v1/chat/completions", json=chat)
        completion = await h.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi.", "n": 3})
        requests = list(h.worker.requests)
    assert unbounded.status_code == 400, unbounded.text
    assert unbounded.json()["error"]["param"] == "max_tokens"
    assert "MET_MAX_REQUEST_WORK" in unbounded.json()["error"]["message"]
    assert bounded.status_code == 200, bounded.text
    assert completion.status_code == 200, completion.text
    assert [request.max_tokens for request in requests] == [8, 16]
