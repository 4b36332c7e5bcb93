"""A tool call cut off by ``max_tokens`` or a stop string comes back as a ``tool_calls`` entry with the
arguments written so far, never as call markup in ``content``, whole and streamed alike:
``finish_reason`` is ``"length"`` for ``max_tokens`` (as OpenAI gives it) and ``"stop"`` for a stop
string (never ``"tool_calls"``: the call is incomplete)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from metrale.shared.messages import ModelAnnouncement
from metrale.text.tokenizer import Tokenizer
from tests.gateway.api.test_tools import (
    BUILTIN,
    HERMES_REPLY,
    KIMI_REPLY,
    chat,
    hermes_script,
    kimi_script,
)
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import encode, gateway_harness, sse_payloads, token_text

pytestmark = pytest.mark.anyio

MARKUP = ("<tool_call", "</tool_call", "<|tool", '{"name"', "functions.")
CUT_INSIDE = '{"city": "Pa'
"""Where the cut falls: inside get_weather's arguments (``{"city": "Paris"}``)."""


def tokens_until_cut(tokens: list[int], decode: Callable[[list[int]], str]) -> int:
    """The fewest of ``tokens`` whose text reaches into the first call's arguments but not past them."""
    for count in range(1, len(tokens)):
        text = decode(tokens[:count])
        if CUT_INSIDE in text:
            assert '"Paris"' not in text
            return count
    raise AssertionError("the reply never reaches the cut")


def builtin_text(ids: list[int]) -> str:
    """The built-in tokenizer's text of ``ids`` (the replies here are ASCII: token by token is exact)."""
    return "".join(token_text(token) for token in ids)


async def whole_and_streamed(
    script: FakeWorkerScript, model: ModelAnnouncement, body: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The choice of the whole answer, and the choice pieces of the streamed one."""
    async with gateway_harness(script, model=model) as h:
        whole = await h.http.post("/v1/chat/completions", json=body)
        streamed = await h.http.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole.status_code == streamed.status_code == 200, (whole.text, streamed.text)
    (choice,) = whole.json()["choices"]
    pieces = [chunk["choices"][0] for chunk in sse_payloads(streamed.text) if chunk["choices"]]
    return choice, pieces


def assert_cut_call(choice: dict[str, Any], pieces: list[dict[str, Any]], content: str, reason: str) -> None:
    """The whole answer and the stream both end in one get_weather call cut inside its arguments."""
    message = choice["message"]
    assert choice["finish_reason"] == reason
    assert (message["content"] or "") == content
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"]
    assert call["function"]["arguments"].startswith('{"city": "P')
    assert not call["function"]["arguments"].startswith('{"city": "Paris"')
    streamed_content = [p["delta"].get("content") or "" for p in pieces]
    assert "".join(streamed_content) == content
    assert not any(marker in piece for piece in streamed_content for marker in MARKUP)
    entries = [e for p in pieces for e in p["delta"].get("tool_calls", [])]
    assert {e["index"] for e in entries} == {0}
    assert [e["function"]["name"] for e in entries if "id" in e] == ["get_weather"]
    assert "".join(e["function"]["arguments"] for e in entries) == call["function"]["arguments"]
    assert [p["finish_reason"] for p in pieces if p["finish_reason"]] == [reason]


async def test_a_hermes_call_cut_by_max_tokens_is_a_call_with_length() -> None:
    cut = tokens_until_cut(encode(HERMES_REPLY), builtin_text)
    choice, pieces = await whole_and_streamed(hermes_script(), BUILTIN, chat(max_tokens=cut))
    assert_cut_call(choice, pieces, "Sure.\n", "length")


async def test_a_kimi_call_cut_by_max_tokens_is_a_call_with_length(kimi: tuple[ModelAnnouncement, Tokenizer]) -> None:
    announced, tokenizer = kimi
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    cut = tokens_until_cut(tokenizer.encode(KIMI_REPLY), decode)
    choice, pieces = await whole_and_streamed(kimi_script(tokenizer), announced, chat(max_tokens=cut))
    assert_cut_call(choice, pieces, "Sure.", "length")


async def test_a_call_cut_by_a_stop_string_is_a_call_with_stop_not_tool_calls() -> None:
    choice, pieces = await whole_and_streamed(hermes_script(), BUILTIN, chat(stop=["aris"]))
    assert_cut_call(choice, pieces, "Sure.\n", "stop")
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "P'


async def test_a_reply_cut_while_its_call_tag_opens_shows_no_part_of_the_tag() -> None:
    tokens = encode(HERMES_REPLY)
    cut = next(n for n in range(1, len(tokens)) if builtin_text(tokens[:n]).endswith("<tool"))
    choice, pieces = await whole_and_streamed(hermes_script(), BUILTIN, chat(max_tokens=cut))
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "Sure.\n" and "tool_calls" not in choice["message"]
    assert "".join(p["delta"].get("content") or "" for p in pieces) == "Sure.\n"
