"""schemathesis over the gateway's own OpenAPI document: every operation, valid and invalid inputs.

The app runs on fakeredis with the fake worker (so generation requests for the served model complete),
driven through httpx's ASGI transport. Hypothesis runs in a thread of its own and hands each request
to the event loop that runs the app, so the worker and the relay keep running between requests.
Every answer must be documented (status, content type, body schema) and none may be a 5xx.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.gateway.harness import MODEL, gateway_harness

pytestmark = pytest.mark.anyio

CASES_PER_OPERATION = 100
GENERATION_CASES = 400
"""Chat and completions get more cases (their bodies are the largest); over 2,000 requests in all."""
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
TIME_LIMIT_S = 240.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


AIMS = ("as-generated", "served-model", "served-model-and-a-plain-chat")


def _aimed_at_the_model(case: Any, aim: str) -> None:
    """Point some generated bodies at the served model (and some chats at a plain user turn), so
    generation gets past the 404 and the chat template."""
    if aim == "as-generated":
        return
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
        if aim == "served-model-and-a-plain-chat" and "messages" in case.body:
            case.body["messages"] = [{"role": "user", "content": "Hello."}]
    if case.path_parameters and "model_id" in case.path_parameters:
        case.path_parameters["model_id"] = MODEL


async def test_every_operation_answers_only_what_its_document_says(tmp_path: Path) -> None:
    async with gateway_harness(files_dir=tmp_path, request_timeout_s=2.0) as h:
        schema = schemathesis.openapi.from_dict(h.app.openapi())
        loop = asyncio.get_running_loop()
        statuses: dict[str, dict[int, int]] = {}
        started = time.monotonic()

        def send(case: Any) -> httpx.Response:
            kwargs = {k: v for k, v in case.as_transport_kwargs().items() if k in _HTTPX_KWARGS}
            if isinstance(kwargs.get("data"), bytes | str):
                kwargs["content"] = kwargs.pop("data")
            try:
                request = h.http.build_request(**kwargs)
                request.read()  # so the request's bytes can be shown when a check fails
            except (TypeError, AttributeError):  # a negative multipart part httpx cannot encode
                reject()
            return asyncio.run_coroutine_threadsafe(h.http.send(request), loop).result(timeout=30)

        def fuzz_operations() -> int:
            sent = 0
            for result in schema.get_all_operations():
                operation = result.ok()
                seen = statuses.setdefault(f"{operation.method.upper()} {operation.path}", {})
                sent += _fuzz(operation, send, seen)
            return sent

        async def keep_beating() -> None:  # the fake worker beats once; a live one keeps beating
            while True:
                await asyncio.sleep(5.0)
                await h.worker.announce()

        beating = asyncio.create_task(keep_beating())
        try:
            sent = await asyncio.to_thread(fuzz_operations)
        finally:
            beating.cancel()
        elapsed = time.monotonic() - started
    print(f"{sent} requests in {elapsed:.0f} s: {statuses}")
    assert sent >= 1_000
    document = h.app.openapi()
    assert len(statuses) == sum(len(operations) for operations in document["paths"].values())  # all of them
    assert elapsed < TIME_LIMIT_S
    assert all(status < 500 for seen in statuses.values() for status in seen)
    assert all(200 in statuses[f"POST {path}"] for path in GENERATION_PATHS)  # some got generated


async def test_the_document_describes_the_generation_bodies() -> None:
    async with gateway_harness() as h:
        document = h.app.openapi()
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        fields = document["components"]["schemas"][model]["properties"]
        assert {"model", "logit_bias", "temperature", "stream"} <= fields.keys()
        assert document["components"]["schemas"][model]["additionalProperties"] is False


def _fuzz(operation: Any, send: Callable[[Any], httpx.Response], seen: dict[int, int]) -> int:
    """Send ``operation`` its positive and negative cases, counting statuses in ``seen``; the number sent."""
    strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    sent = 0

    @settings(
        max_examples=GENERATION_CASES if operation.path in GENERATION_PATHS else CASES_PER_OPERATION,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy, aim=st.sampled_from(AIMS))
    def fuzz(case: Any, aim: str) -> None:
        nonlocal sent
        _aimed_at_the_model(case, aim)
        response = send(case)
        sent += 1
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        case.validate_response(response, checks=CHECKS)

    fuzz()
    return sent


_HTTPX_KWARGS = {"method", "url", "params", "headers", "content", "data", "files", "json"}
