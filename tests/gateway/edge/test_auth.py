"""API keys at the door: a request carrying ``Authorization`` more than once is refused with a 400 on
every route, the fast path of load shedding included, never served as the first key's tenant."""

from __future__ import annotations

from typing import Any

import pytest

from metrale.gateway.edge.auth import ApiKeyAuth, authorization_header
from metrale.shared.errors import BadRequest
from metrale.shared.messages import Priority
from tests.gateway.api.test_admission import beat
from tests.gateway.harness import MODEL, Harness, gateway_harness

pytestmark = pytest.mark.anyio

KEYS = {"sk-a": "acme", "sk-b": "globex"}
TWO_KEYS = [("Authorization", "Bearer sk-a"), ("Authorization", "Bearer sk-b")]
CHAT = "/v1/chat/completions"


def chat() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def assert_refused(response: Any, count: int = 2) -> None:
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": f"The request carries {count} Authorization headers: send exactly one "
        "('Authorization: Bearer <key>').",
        "type": "invalid_request_error",
        "param": "Authorization",
        "code": "invalid_request",
    }


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param([], None, id="none"),
        pytest.param([(b"authorization", b"Bearer sk-a")], "Bearer sk-a", id="one"),
        pytest.param([(b"Authorization", b"Bearer sk-a"), (b"x", b"y")], "Bearer sk-a", id="one-capitalised"),
    ],
)
def test_the_one_header_is_read(headers: list[tuple[bytes, bytes]], expected: str | None) -> None:
    assert authorization_header(headers) == expected
    if expected is not None:
        assert ApiKeyAuth(KEYS).tenant_for(expected) == "acme"


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([(b"authorization", b"Bearer sk-a"), (b"authorization", b"Bearer sk-b")], id="two-keys"),
        pytest.param([(b"authorization", b"Bearer sk-a")] * 2, id="the-same-key-twice"),
        pytest.param([(b"authorization", b"Bearer sk-a"), (b"authorization", b"")], id="one-empty"),
    ],
)
def test_several_headers_are_a_bad_request(headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(BadRequest, match="carries 2 Authorization headers"):
        authorization_header(headers)


async def test_two_headers_are_refused_on_every_route() -> None:
    async with gateway_harness(api_keys=KEYS) as h:
        answered = await h.http.post(CHAT, headers=[("Authorization", "Bearer sk-a")], json=chat())
        three = await h.http.post(CHAT, headers=[*TWO_KEYS, ("Authorization", "Bearer sk-a")], json=chat())
        responses = [
            await h.http.post(CHAT, headers=TWO_KEYS, json=chat()),
            await h.http.get("/v1/models", headers=TWO_KEYS),
            await h.http.post("/v1/responses", headers=TWO_KEYS, json={"model": MODEL, "input": "Hi"}),
            await h.http.get("/v1/batches", headers=TWO_KEYS),
        ]
        submitted = [request.request_id for request in h.worker.requests]
        metrics = (await h.http.get("/metrics")).text
    assert answered.status_code == 200, answered.text
    assert_refused(three, count=3)
    for response in responses:
        assert_refused(response)
    assert len(submitted) == 1  # only the request with one key ran
    assert 'metrale_requests_total{endpoint="chat",status="400"} 2.0' in metrics


async def test_two_headers_are_refused_while_the_fleet_is_full_too() -> None:
    """The load-shedding fast path answers a full fleet's 429 only to a request with one valid key."""
    async with gateway_harness(worker_running=False, max_queue_wait_s=5.0, api_keys=KEYS) as h:
        await full_fleet(h)
        one = await h.http.post(CHAT, headers=[("Authorization", "Bearer sk-a")], json=chat())
        two = await h.http.post(CHAT, headers=TWO_KEYS, json=chat())
    assert one.status_code == 429
    assert_refused(two)


async def test_an_open_gateway_does_not_read_the_header() -> None:
    async with gateway_harness() as h:
        response = await h.http.post(CHAT, headers=TWO_KEYS, json=chat())
    assert response.status_code == 200, response.text


async def full_fleet(h: Harness) -> None:
    await beat(h, slots=2, finished=10, slot_ms=10_000)
    for _ in range(20):
        await h.redis.xadd(h.keys.request_stream(Priority.INTERACTIVE), {"msg": b"waiting"})
    judged = await h.http.post(CHAT, headers=[("Authorization", "Bearer sk-a")], json=chat())  # reads the streams
    assert judged.status_code == 429
