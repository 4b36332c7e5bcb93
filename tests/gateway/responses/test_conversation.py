"""A continuation's prompt is the previous transcript verbatim, then the text the template adds after the
reply's content (its end of turn only once, when the reply's stop token was that text)."""

from __future__ import annotations

import pytest

from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.gateway.responses.conversation import ResponsePrompt, response_prompt
from metrale.gateway.responses.items import chat_messages, input_items
from metrale.gateway.responses.refusals import refuse_unsupported
from metrale.gateway.responses.store import StoredResponse
from metrale.shared.errors import BadRequest
from metrale.shared.sessions import Transcript
from metrale.text.tokenizer import Tokenizer
from metrale.worker.model.builtin import builtin_model_dir


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(builtin_model_dir())


def _body(**fields: object) -> ResponseCreateRequest:
    return ResponseCreateRequest.model_validate({"model": "m", **fields})


def _after(tokenizer: Tokenizer, prompt: ResponsePrompt, reply_ids: list[int], stop_text: str) -> StoredResponse:
    reply_text = tokenizer.decode([t for t in reply_ids if t not in tokenizer.special_token_ids])
    transcript = Transcript(
        prompt.text + reply_text + stop_text, (*prompt.token_ids, *reply_ids), len(prompt.token_ids)
    )
    messages = [*prompt.messages, {"role": "assistant", "content": reply_text}]
    return StoredResponse({}, [], messages, transcript, prompt.rendered + reply_text, stop_text)


@pytest.mark.parametrize("stop", ["<|im_end|>", "<|eos|>", None])
def test_a_continuation_extends_the_exact_tokens(tokenizer: Tokenizer, stop: str | None) -> None:
    first_body = _body(input="Hello", instructions="Be brief.")
    first = response_prompt(tokenizer, first_body, input_items(first_body), None)
    assert first.token_ids == tokenizer.encode(first.text) and first.marks == []
    # " there" tokenized unusually (as single characters) and, maybe, a stop token.
    reply = [*(tokenizer.encode(c)[0] for c in " there"), *([tokenizer.token_to_id(stop)] if stop else [])]
    stored = _after(tokenizer, first, [t for t in reply if t is not None], stop or "")
    second_body = _body(input="And then?", previous_response_id="resp-1")
    second = response_prompt(tokenizer, second_body, input_items(second_body), stored)
    consumed = stored.transcript.token_ids
    assert tuple(second.token_ids[: len(consumed)]) == consumed
    assert second.marks == [len(consumed) - 1, len(consumed)]
    new_text = tokenizer.decode(second.token_ids[len(consumed) :], skip_special_tokens=False)
    end_of_turn = "" if stop == "<|im_end|>" else "<|im_end|>"
    assert new_text == f"{end_of_turn}\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_fields_are_refused_by_name() -> None:
    cases = {
        "max_tokens": _body(input="x", max_tokens=4),
        "background": _body(input="x", background=True, store=False),
        "n": _body(input="x", n=2),
        "include": _body(input="x", include=["reasoning.encrypted_content"]),
        "truncation": _body(input="x", truncation="auto"),
        "response_format": _body(input="x", response_format={"type": "json_object"}),
    }
    for param, body in cases.items():
        with pytest.raises(BadRequest) as refused:
            refuse_unsupported(body)
        assert refused.value.param == param
    refuse_unsupported(_body(input="x", max_output_tokens=4, tool_choice="none", include=[], truncation="disabled"))


def test_message_and_function_call_items_become_chat_messages() -> None:
    items = input_items(
        _body(
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
            ]
        )
    )
    assert chat_messages(items) == [
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": "b",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    with pytest.raises(BadRequest, match="item_reference"):
        input_items(_body(input=[{"type": "item_reference", "id": "x"}]))
    with pytest.raises(BadRequest, match="input_image"):
        input_items(_body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]))
