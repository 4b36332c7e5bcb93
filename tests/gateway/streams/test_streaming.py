"""SSE events: the fast encoder's bytes are the reference encoder's (pydantic's JSON of the response
models, every line break escaped by the plain regex), for random deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.gateway.api.chat import ChatRenderer
from metrale.gateway.api.completions import CompletionRenderer
from metrale.gateway.response_bodies import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
)
from metrale.gateway.streams.choice import ChoiceDelta
from metrale.gateway.streams.streaming import line_safe, line_safe_reference, sse_event
from metrale.shared.messages import FinishReason

PROPERTY = settings(derandomize=True, deadline=None, max_examples=300)

LINE_BREAKS = "\u0085\u2028\u2029"
# Mostly ASCII (the fast path), with JSON's escapes, the three line breaks JSON keeps and other non-ASCII.
texts = st.text(alphabet=st.sampled_from(f'ab "\\\n\t\x00é€😀{LINE_BREAKS}') | st.characters())
models = st.sampled_from(["metrale-tiny-random", 'tiny "kimi" é\u2028'])
reasons = st.none() | st.sampled_from(FinishReason)


def reference_event(chunk: ChatCompletionChunk | Completion) -> str:
    return f"data: {line_safe_reference(chunk.model_dump_json())}\n\n"


@PROPERTY
@given(text=texts)
def test_line_safe_is_its_reference(text: str) -> None:
    assert line_safe(text) == line_safe_reference(text)


@pytest.mark.parametrize(
    ("text", "escaped"),
    [
        pytest.param('{"t":"a"}', '{"t":"a"}', id="ascii"),
        pytest.param('{"t":"é"}', '{"t":"é"}', id="non-ascii-kept"),
        pytest.param('{"t":"a\u2028b\u0085"}', '{"t":"a\\u2028b\\u0085"}', id="line-breaks-escaped"),
    ],
)
def test_line_safe_escapes_only_the_line_breaks_json_keeps(text: str, escaped: str) -> None:
    assert line_safe(text) == escaped
    assert json.loads(line_safe(text)) == json.loads(text)


@PROPERTY
@given(model=models, text=texts, index=st.integers(0, 1), reason=reasons)
def test_a_chat_event_is_the_reference_encoders(model: str, text: str, index: int, reason: FinishReason | None) -> None:
    renderer = ChatRenderer(request_id="chatcmpl-1", model=model, fingerprint="ab" * 32, n=2, logprobs=None)
    chunk = renderer.delta_chunk(ChoiceDelta(index, text, [1], None, None, reason))
    if chunk is None:
        assert not text and reason is None
        return
    expected = ChatCompletionChunk(
        id="chatcmpl-1",
        created=json.loads(chunk)["created"],
        model=model,
        system_fingerprint="met-abababababab",
        choices=[ChatChunkChoice(index=index, delta=ChatDelta(content=text), logprobs=None, finish_reason=reason)],
    )
    event = sse_event(chunk)
    assert event == reference_event(expected)
    assert len(event.rstrip("\n").splitlines()) == 1


@PROPERTY
@given(model=models, text=texts, index=st.integers(0, 1), reason=reasons)
def test_a_completion_event_is_the_reference_encoders(
    model: str, text: str, index: int, reason: FinishReason | None
) -> None:
    renderer = CompletionRenderer(request_id="cmpl-1", model=model, fingerprint="ab" * 32, n=2, logprobs=None)
    chunk = renderer.delta_chunk(ChoiceDelta(index, text, [1], None, None, reason))
    if chunk is None:
        assert not text and reason is None
        return
    expected = Completion(
        id="cmpl-1",
        created=json.loads(chunk)["created"],
        model=model,
        system_fingerprint="met-abababababab",
        choices=[CompletionChoice(index=index, text=text, logprobs=None, finish_reason=reason)],
    )
    event = sse_event(chunk)
    assert event == reference_event(expected)
    assert len(event.rstrip("\n").splitlines()) == 1
