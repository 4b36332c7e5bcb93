"""``GET`` / ``DELETE /v1/sessions/{id}``: the ids chat accepts, and only those, inspected and deleted."""

from __future__ import annotations

import pytest

from tests.gateway.harness import MODEL, gateway_harness

pytestmark = pytest.mark.anyio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there."}]}


@pytest.mark.parametrize("session", ["s1", "team/s2", "a.b_c-d@e+f=g", "x" * 256])
async def test_a_session_chat_accepts_can_be_inspected_and_deleted(session: str) -> None:
    async with gateway_harness() as h:
        chat = await h.http.post("/v1/chat/completions", json={**CHAT, "session": session})
        assert chat.status_code == 200, chat.json()
        shown = await h.http.get(f"/v1/sessions/{session}")
        assert shown.status_code == 200 and shown.json()["id"] == session
        assert shown.json()["transcript_tokens"] > 0
        deleted = await h.http.delete(f"/v1/sessions/{session}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert (await h.http.get(f"/v1/sessions/{session}")).status_code == 404


@pytest.mark.parametrize("session", ["a:b", "has space", "x" * 257, "star*", "caf\u00e9"])
async def test_an_invalid_session_id_is_a_400_everywhere(session: str) -> None:
    async with gateway_harness() as h:
        by_body = await h.http.post("/v1/chat/completions", json={**CHAT, "session": session})
        assert by_body.status_code == 400 and by_body.json()["error"]["param"] == "session"
        header = session.encode()  # a header carries bytes; httpx would refuse to encode non-ASCII text
        by_header = await h.http.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": header})
        assert by_header.status_code == 400 and by_header.json()["error"]["param"] == "session"
        for method in ("GET", "DELETE"):
            answer = await h.http.request(method, f"/v1/sessions/{session}")
            assert answer.status_code == 400, (method, answer.json())
            assert answer.json()["error"]["param"] == "session_id"
        assert h.worker.requests == []


async def test_an_unknown_valid_session_is_a_404() -> None:
    async with gateway_harness() as h:
        assert (await h.http.get("/v1/sessions/never-used")).status_code == 404
        assert (await h.http.delete("/v1/sessions/team/never-used")).status_code == 404
