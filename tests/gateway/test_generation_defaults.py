"""A model's ``generation_config.json`` supplies the sampling fields a request leaves out (vLLM's
``--generation-config auto``); what the request sets wins, and a model without one keeps the API's
defaults."""

from __future__ import annotations

import dataclasses
import json

import pytest

from metrale.gateway.generation_defaults import sampling_defaults, with_sampling_defaults
from metrale.gateway.request_bodies import ChatCompletionRequest
from tests.gateway.harness import MODEL, announcement, gateway_harness

pytestmark = pytest.mark.anyio

QWEN_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "presence_penalty": 1.5, "eos_token_id": [2]}


def test_only_the_sampling_keys_of_the_right_type_are_defaults() -> None:
    config = {**QWEN_DEFAULTS, "top_k": 20.0, "min_p": "0.1", "repetition_penalty": True, "do_sample": True}
    assert dict(sampling_defaults(json.dumps(config))) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "presence_penalty": 1.5,
    }
    assert dict(sampling_defaults("[1]")) == {} == dict(sampling_defaults("not json"))


def test_a_field_the_request_sets_wins_over_the_default() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}
    )
    defaulted = with_sampling_defaults(body, sampling_defaults(json.dumps(QWEN_DEFAULTS)))
    assert (defaulted.temperature, defaulted.top_p, defaulted.top_k, defaulted.presence_penalty) == (0.0, 0.95, 20, 1.5)
    assert defaulted.frequency_penalty == 0.0


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_the_worker_gets_the_models_defaults_for_what_a_request_leaves_out(endpoint: str) -> None:
    model = dataclasses.replace(announcement(), generation_config_json=json.dumps(QWEN_DEFAULTS))
    prompts = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        "/v1/completions": {"prompt": "hi", "max_tokens": 4},
        "/v1/responses": {"input": "hi", "max_output_tokens": 4, "store": False},
    }
    async with gateway_harness(model=model) as h:
        reply = await h.http.post(endpoint, json={"model": MODEL, "top_p": 0.5, **prompts[endpoint]})
        assert reply.status_code == 200, reply.text
    (request,) = h.worker.requests
    assert (request.temperature, request.top_p, request.top_k, request.presence_penalty) == (0.6, 0.5, 20, 1.5)


async def test_a_model_without_a_generation_config_keeps_the_api_defaults() -> None:
    async with gateway_harness() as h:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert (await h.http.post("/v1/chat/completions", json=body)).status_code == 200
    (request,) = h.worker.requests
    assert (request.temperature, request.top_p, request.top_k, request.presence_penalty) == (1.0, 1.0, 0, 0.0)
