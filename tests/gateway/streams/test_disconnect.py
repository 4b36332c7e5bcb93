"""A client that goes away mid-stream: the gateway cancels its request on the worker at once."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.types import Message

from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, aborted_record, gateway_harness

pytestmark = pytest.mark.anyio

BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}).encode()


@pytest.fixture(params=["fakeredis", pytest.param("redis", marks=pytest.mark.redis)])
def redis_url(request: pytest.FixtureRequest) -> str | None:
    """fakeredis, and a real server: only a real socket makes the cancel's PUBLISH really wait, which
    is where a cancelled stream would lose it."""
    return request.getfixturevalue("real_redis_url") if request.param == "redis" else None


async def test_a_disconnect_cancels_the_request_within_a_step(redis_url: str | None) -> None:
    script = FakeWorkerScript(lambda request, index: [7] * 50, step_s=0.02)
    async with gateway_harness(script, redis_url=redis_url) as h:
        first_chunk_sent = asyncio.Event()
        body_read = False

        async def receive() -> Message:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": BODY, "more_body": False}
            await first_chunk_sent.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                first_chunk_sent.set()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())],
            "client": ("127.0.0.1", 5000),
            "server": ("gateway", 80),
            "state": {},
        }
        async with asyncio.timeout(3):
            await h.app(scope, receive, send)
        (request,) = h.worker.requests
        record = await aborted_record(h, request.request_id)
    assert [(c.request_id, c.reason) for c in h.worker.cancels] == [(request.request_id, "client disconnected")]
    assert record is not None and len(record.token_ids()) < 20  # stopped long before its 50 tokens
    assert not h.app.state.gateway.relay._streams  # the request's subscription is gone
