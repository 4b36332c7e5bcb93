"""Fields that were accepted and silently ignored, and schemas no finite output satisfies: each is
refused with a 400 that names it, up front, never answered as a success with something else."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.hostile.conftest import ALPHA, Server, error_of
from tests.hostile.health_watch import watching_health

pytestmark = [pytest.mark.slow]


def _chat(server: Server, content: Any = "def f(", **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def _refused(server: Server, body: dict[str, Any], *named: str) -> None:
    with watching_health(server.base_url) as health:
        response = server.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text[:500]
    message = error_of(response)["message"]
    for name in named:
        assert name in message, message
    health[0].assert_responsive()


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "hologram", "hologram": {}},
    ],
    ids=["image", "audio", "unknown"],
)
def test_a_content_part_that_is_not_text(server: Server, part: dict[str, Any]) -> None:
    _refused(server, _chat(server, [{"type": "text", "text": "what is this?"}, part]), part["type"])


@pytest.mark.parametrize("key", ["bos_token", "tools", "messages"])
def test_template_kwargs_that_override_the_server(server: Server, key: str) -> None:
    _refused(server, _chat(server, chat_template_kwargs={key: "x"}), key)


def test_max_tokens_and_max_completion_tokens_together(server: Server) -> None:
    _refused(server, _chat(server, max_completion_tokens=16), "max_tokens", "max_completion_tokens")


def test_two_authorization_headers(server: Server) -> None:
    headers = [("Authorization", f"Bearer {ALPHA}"), ("Authorization", "Bearer sk-somebody-else")]
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=_chat(server), headers=headers, timeout=30)
    assert response.status_code in (400, 401), response.text[:500]
    assert "Authorization" in error_of(response)["message"]


SELF_RECURSIVE = {
    "type": "object",
    "properties": {"child": {"$ref": "#"}},
    "required": ["child"],
}
REF_CYCLE = {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    "$ref": "#/$defs/a",
}


@pytest.mark.parametrize("schema", [SELF_RECURSIVE, REF_CYCLE], ids=["self-recursive", "ref-cycle"])
def test_a_schema_no_finite_output_satisfies(server: Server, schema: dict[str, Any]) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "endless", "schema": schema, "strict": True}}
    _refused(server, _chat(server, response_format=response_format), "schema")


def test_a_forced_tool_no_finite_call_satisfies(server: Server) -> None:
    tool = {"type": "function", "function": {"name": "endless", "parameters": SELF_RECURSIVE}}
    _refused(server, _chat(server, tools=[tool], tool_choice="required"), "endless")
