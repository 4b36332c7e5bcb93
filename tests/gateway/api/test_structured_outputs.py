"""``response_format`` on chat and text completions: the grammar the worker receives, and the 400s."""

from __future__ import annotations

from typing import Any

import pytest

from metrale.gateway.api.prepare.structured_outputs import request_grammar
from metrale.gateway.fleet.registry import ServedModel, build_tokenizer
from metrale.gateway.request_bodies import ChatCompletionRequest
from metrale.shared.errors import BadRequest
from metrale.text.grammars import json_object_grammar, json_schema_grammar
from tests.gateway.harness import MODEL, announcement, gateway_harness, sse_payloads

MESSAGES = [{"role": "user", "content": "Describe a lighthouse keeper."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "keeper", "schema": SCHEMA, "strict": True}}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "A lighthouse keeper:", "max_tokens": 8, **extra}


@pytest.mark.parametrize(
    ("response_format", "grammar"),
    [
        pytest.param(None, None, id="absent"),
        pytest.param({"type": "text"}, None, id="text"),
        pytest.param({"type": "json_object"}, json_object_grammar(), id="json_object"),
        pytest.param(JSON_SCHEMA_FORMAT, json_schema_grammar(SCHEMA), id="json_schema"),
        pytest.param(
            {"type": "json_schema", "json_schema": {"name": "keeper", "schema": SCHEMA}},
            json_schema_grammar(SCHEMA),
            id="json_schema-not-strict",  # as in vLLM, the schema constrains whatever strict says
        ),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.anyio
async def test_the_response_format_becomes_the_requests_grammar(
    response_format: dict[str, Any] | None, grammar: str | None, endpoint: str, stream: bool
) -> None:
    extra = {"stream": stream} if response_format is None else {"stream": stream, "response_format": response_format}
    body = chat(**extra) if endpoint == "/v1/chat/completions" else completion(**extra)
    async with gateway_harness() as h:
        response = await h.http.post(endpoint, json=body)
        (request,) = h.worker.requests
    assert response.status_code == 200, response.text
    assert request.grammar == grammar
    if stream:
        sse_payloads(response.text)  # a well-formed stream, as without a response_format


@pytest.mark.parametrize(
    ("response_format", "named"),
    [
        pytest.param(
            {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "object", "not": {"type": "null"}}},
            },
            'unsupported schema: Unimplemented keys: ["not"]',
            id="unimplemented-keyword",
        ),
        pytest.param(
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "format": "colour"}}},
            "unsupported schema: Unknown format: colour",
            id="unknown-format",
        ),
        pytest.param(
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "(?=x)"}}},
            "look-around",
            id="regex-construct",
        ),
        pytest.param({"type": "json_schema", "json_schema": {"name": "s"}}, "needs json_schema.schema", id="no-schema"),
        pytest.param({"type": "json_schema"}, "needs json_schema.schema", id="no-json_schema"),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.anyio
async def test_a_schema_that_cannot_constrain_is_a_400_naming_the_construct(
    response_format: dict[str, Any], named: str, endpoint: str
) -> None:
    body = (
        chat(response_format=response_format)
        if endpoint == "/v1/chat/completions"
        else completion(response_format=response_format)
    )
    async with gateway_harness() as h:
        response = await h.http.post(endpoint, json=body)
        assert h.worker.requests == []
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in error["message"]
    assert error["param"] == "response_format"


@pytest.mark.anyio
async def test_an_unknown_response_format_type_is_refused() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat(response_format={"type": "yaml"}))
        assert h.worker.requests == []
    assert response.status_code in (400, 422)


@pytest.mark.anyio
async def test_ignore_eos_without_stop_tokens_cannot_end_a_constrained_output() -> None:
    async with gateway_harness() as h:
        refused = await h.http.post(
            "/v1/chat/completions", json=chat(response_format={"type": "json_object"}, ignore_eos=True)
        )
        accepted = await h.http.post(
            "/v1/chat/completions",
            json=chat(response_format={"type": "json_object"}, ignore_eos=True, stop_token_ids=[5]),
        )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "ignore_eos"
    assert accepted.status_code == 200


def test_a_tool_plans_grammar_is_checked_and_governs_a_response_format_which_is_checked_too() -> None:
    model = ServedModel(announcement(), build_tokenizer(announcement()))
    plain = ChatCompletionRequest.model_validate(chat())
    assert request_grammar(plain, model, 'start: "call"') == 'start: "call"'
    with pytest.raises(BadRequest, match="unknown special token") as broken:
        request_grammar(plain, model, "start: <|no_such_token|>")
    assert broken.value.param == "tool_choice"
    formatted = ChatCompletionRequest.model_validate(chat(response_format={"type": "json_object"}))
    assert request_grammar(formatted, model, 'start: "call"') == 'start: "call"'  # the plan holds the format
    nonsense = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "nonsense"}}}
    unsupported = ChatCompletionRequest.model_validate(chat(response_format=nonsense))
    with pytest.raises(BadRequest, match="nonsense") as schema:
        request_grammar(unsupported, model, 'start: "call"')
    assert schema.value.param == "response_format"
    text_format = ChatCompletionRequest.model_validate(chat(response_format={"type": "text"}))
    assert request_grammar(text_format, model, 'start: "call"') == 'start: "call"'


ENDLESS_SCHEMAS = {
    "self-recursive": {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]},
    "ref-cycle": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "empty-enum": {"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]},
}


@pytest.mark.parametrize("name", sorted(ENDLESS_SCHEMAS))
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.anyio
async def test_a_schema_no_finite_value_satisfies_is_a_400_before_any_work(name: str, endpoint: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "endless", "schema": ENDLESS_SCHEMAS[name]}}
    body = chat if endpoint == "/v1/chat/completions" else completion
    async with gateway_harness() as h:
        response = await h.http.post(endpoint, json=body(response_format=response_format))
        assert h.worker.requests == []
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert error["message"].startswith("response_format.json_schema.schema admits no finite JSON value")


@pytest.mark.anyio
async def test_a_recursive_schema_that_can_end_is_served() -> None:
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat(response_format=response_format))
        (request,) = h.worker.requests
    assert response.status_code == 200, response.text
    assert request.grammar == json_schema_grammar(tree)
