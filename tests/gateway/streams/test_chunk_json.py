"""Stream chunks built as JSON text must be exactly what pydantic writes for the response models."""

from __future__ import annotations

import json
from collections.abc import Sequence

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
from metrale.gateway.streams.chunk_json import ChunkEnvelope, json_text
from metrale.gateway.streams.logprobs import LogprobFormatter
from metrale.shared.messages import FinishReason

PROPERTY = settings(derandomize=True, deadline=None, max_examples=200)

REQUEST_ID = "chatcmpl-0f"
MODEL = 'tiny "kimi" é\n'
FINGERPRINT = "ab" * 32
TOKEN_IDS = [1, 2]
LOGPROBS = [-0.5, -1.25e-07]
TOP_LOGPROBS = [[(3, -2.0), (1, -0.5)], []]

texts = st.text(min_size=1)  # anything a tokenizer can decode, control characters and emoji included
reasons = st.none() | st.sampled_from(FinishReason)


class TokenNames:
    """A decoder that names each token (one of them needs escaping in JSON)."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(f'"t{token_id}é\t' for token_id in ids)


def _delta(index: int, text: str, reason: FinishReason | None, with_logprobs: bool) -> ChoiceDelta:
    if with_logprobs:
        return ChoiceDelta(index, text, TOKEN_IDS, LOGPROBS, TOP_LOGPROBS, reason)
    return ChoiceDelta(index, text, TOKEN_IDS, None, None, reason)


def _formatter(with_logprobs: bool) -> LogprobFormatter | None:
    return LogprobFormatter(TokenNames()) if with_logprobs else None


@PROPERTY
@given(text=texts, index=st.integers(0, 1), reason=reasons, with_logprobs=st.booleans())
def test_a_chat_delta_chunk_is_what_pydantic_writes(
    text: str, index: int, reason: FinishReason | None, with_logprobs: bool
) -> None:
    renderer = ChatRenderer(
        request_id=REQUEST_ID, model=MODEL, fingerprint=FINGERPRINT, n=2, logprobs=_formatter(with_logprobs)
    )
    chunk = renderer.delta_chunk(_delta(index, text, reason, with_logprobs))
    assert chunk is not None
    formatter = _formatter(with_logprobs)
    expected = ChatCompletionChunk(
        id=REQUEST_ID,
        created=json.loads(chunk)["created"],
        model=MODEL,
        system_fingerprint=f"met-{FINGERPRINT[:12]}",
        choices=[
            ChatChunkChoice(
                index=index,
                delta=ChatDelta(content=text),
                logprobs=formatter.chat(TOKEN_IDS, LOGPROBS, TOP_LOGPROBS) if formatter else None,
                finish_reason=reason,
            )
        ],
    )
    assert chunk == expected.model_dump_json()


@PROPERTY
@given(text=texts, index=st.integers(0, 1), reason=reasons, with_logprobs=st.booleans())
def test_a_completion_delta_chunk_is_what_pydantic_writes(
    text: str, index: int, reason: FinishReason | None, with_logprobs: bool
) -> None:
    renderer = CompletionRenderer(
        request_id=REQUEST_ID, model=MODEL, fingerprint=FINGERPRINT, n=2, logprobs=_formatter(with_logprobs)
    )
    chunk = renderer.delta_chunk(_delta(index, text, reason, with_logprobs))
    assert chunk is not None
    formatter = _formatter(with_logprobs)
    logprobs = formatter.completion(TOKEN_IDS, LOGPROBS, TOP_LOGPROBS, 0)[0] if formatter else None
    expected = Completion(
        id=REQUEST_ID,
        created=json.loads(chunk)["created"],
        model=MODEL,
        system_fingerprint=f"met-{FINGERPRINT[:12]}",
        choices=[CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason)],
    )
    assert chunk == expected.model_dump_json()


@pytest.mark.parametrize("renderer_class", [ChatRenderer, CompletionRenderer], ids=["chat", "completion"])
def test_a_delta_with_nothing_to_show_makes_no_chunk(renderer_class: type[ChatRenderer | CompletionRenderer]) -> None:
    renderer = renderer_class(request_id=REQUEST_ID, model=MODEL, fingerprint=FINGERPRINT, n=1, logprobs=None)
    assert renderer.delta_chunk(ChoiceDelta(0, "", [7], None, None, None)) is None


@PROPERTY
@given(text=st.text())
def test_json_text_reads_back_as_the_same_string(text: str) -> None:
    assert json.loads(json_text(text)) == text


def test_the_envelope_wraps_one_choice_and_no_usage() -> None:
    envelope = ChunkEnvelope(id="c-1", object="text_completion", created=7, model="m", system_fingerprint="f")
    assert json.loads(envelope.chunk('{"index":0}')) == {
        "id": "c-1",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "system_fingerprint": "f",
        "choices": [{"index": 0}],
        "usage": None,
    }
