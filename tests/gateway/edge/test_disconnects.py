"""A client gone before its answer: a whole (non-streamed) answer is cancelled on the worker within a
step, and a body cut off mid-read is a quiet 499 with one log line, never a 500 and a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from starlette.types import Message

from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, Harness, aborted_record, eventually, gateway_harness

pytestmark = pytest.mark.anyio

TOKENS = 40  # the harness model has a 64-token context
STEP_S = 0.05


@pytest.fixture(params=["fakeredis", pytest.param("redis", marks=pytest.mark.redis)])
def redis_url(request: pytest.FixtureRequest) -> str | None:
    return request.getfixturevalue("real_redis_url") if request.param == "redis" else None


def http_scope(path: str, body: bytes, content_type: str = "application/json") -> dict[str, object]:
    """An ASGI scope of a ``POST`` to ``path`` declaring ``body``'s length."""
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("gateway", 80),
        "state": {},
    }


async def run_asgi(
    h: Harness,
    scope: dict[str, object],
    chunks: list[bytes],
    gone: Callable[[], Awaitable[None]],
    *,
    whole: bool = True,
) -> list[Message]:
    """Drive ``h.app`` with ``chunks`` of a body (the last ends it when ``whole``; else the body is cut
    off after them), then ``http.disconnect`` once ``gone()`` returns; the messages the app sent."""
    sent: list[Message] = []
    pending = list(chunks)

    async def receive() -> Message:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending) or not whole}
        await gone()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    async with asyncio.timeout(5):
        await h.app(scope, receive, send)
    return sent


def statuses(sent: list[Message]) -> list[int]:
    return [message["status"] for message in sent if message["type"] == "http.response.start"]


async def requests_counted(h: Harness, endpoint: str, status: int) -> float:
    text = (await h.http.get("/metrics")).text
    line = f'metrale_requests_total{{endpoint="{endpoint}",status="{status}"}}'
    found = [row for row in text.splitlines() if row.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_whole_answer_is_cancelled_when_its_client_goes(redis_url: str | None, path: str) -> None:
    script = FakeWorkerScript(lambda request, index: [7] * TOKENS, step_s=STEP_S)
    async with gateway_harness(script, redis_url=redis_url) as h:
        prompt = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
        body = json.dumps({"model": MODEL, "max_tokens": TOKENS, "stream": False, **prompt}).encode()

        async def taken() -> bool:
            return bool(h.worker.requests)

        async def gone() -> None:  # once the worker runs it, for a few steps
            await eventually(taken)
            await asyncio.sleep(5 * STEP_S)

        sent = await run_asgi(h, http_scope(path, body), [body], gone)
        assert h.worker.requests, sent
        (request,) = h.worker.requests
        record = await aborted_record(h, request.request_id)
        endpoint = "chat" if "chat" in path else "completions"
        assert await requests_counted(h, endpoint, 499) == 1
    assert statuses(sent) == [499]
    assert [(c.request_id, c.reason) for c in h.worker.cancels] == [(request.request_id, "client disconnected")]
    assert record is not None and len(record.token_ids()) < TOKENS // 2  # stopped long before its end
    assert not h.app.state.gateway.relay._streams


async def test_a_whole_answer_that_finishes_is_not_cancelled() -> None:
    async with gateway_harness() as h:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        response = await h.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert h.worker.cancels == []


async def test_a_body_cut_off_is_a_499_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    async with gateway_harness() as h:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi " * 1000}]}).encode()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            sent = await run_asgi(h, http_scope("/v1/chat/completions", body), [body[:100]], _at_once, whole=False)
        assert await requests_counted(h, "chat", 499) == 1
        assert await requests_counted(h, "chat", 500) == 0
    assert statuses(sent) == [499]
    assert h.worker.requests == []
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
    assert [r.getMessage() for r in caplog.records if "499" in r.getMessage()] == [
        '127.0.0.1:5000 - "POST /v1/chat/completions HTTP/1.1" 499'
    ]


async def test_an_upload_cut_off_is_a_499(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    boundary = "x" * 16
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    whole = head + b'{"custom_id": "a"}\n' * 1000 + f"\r\n--{boundary}--\r\n".encode()
    async with gateway_harness(files_dir=tmp_path) as h:
        scope = http_scope("/v1/files", whole, f"multipart/form-data; boundary={boundary}")
        with caplog.at_level(logging.INFO):
            sent = await run_asgi(h, scope, [whole[:200], whole[200:5000]], _at_once, whole=False)
        listed = (await h.http.get("/v1/files")).json()
    assert statuses(sent) == [499]
    assert listed["data"] == []
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


async def _at_once() -> None:
    return None
