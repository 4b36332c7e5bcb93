"""The ``speculative`` extension field: ``false`` reaches the worker on chat, completions and responses,
true is the default, and anything but a JSON boolean is refused naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.harness import MODEL, gateway_harness

pytestmark = pytest.mark.anyio

BODIES = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hello there."}]}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "Numbers mattered in her work."}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "Hello there.", "store": False}),
}


async def _post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], list[Any]]:
    async with gateway_harness() as h:
        response = await h.http.post(path, json=body)
        return response.status_code, response.json(), list(h.worker.requests)


@pytest.mark.parametrize(("path", "body"), BODIES.values(), ids=BODIES.keys())
@pytest.mark.parametrize(
    ("given", "sent"), [({}, True), ({"speculative": True}, True), ({"speculative": False}, False)]
)
async def test_speculative_reaches_the_worker(
    path: str, body: dict[str, Any], given: dict[str, bool], sent: bool
) -> None:
    status, answer, requests = await _post(path, {**body, **given})
    assert status == 200, answer
    (request,) = requests
    assert request.speculative is sent


@pytest.mark.parametrize(("path", "body"), BODIES.values(), ids=BODIES.keys())
@pytest.mark.parametrize("value", ["false", 0, None, [False]], ids=["string", "int", "null", "list"])
async def test_a_speculative_that_is_not_a_boolean_is_refused(path: str, body: dict[str, Any], value: Any) -> None:
    status, answer, requests = await _post(path, {**body, "speculative": value})
    assert status == 422, answer  # a wrong type, as for every field (gateway/edge/body.py)
    assert answer["error"]["param"] == "speculative"
    assert requests == []
