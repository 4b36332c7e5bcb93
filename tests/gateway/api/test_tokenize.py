"""``POST /tokenize`` and ``/detokenize`` in vLLM's shapes, with the served tokenizer and template."""

from __future__ import annotations

import pytest

from metrale.text.builtin_tokenizer import BOS_ID
from tests.gateway.harness import MAX_MODEL_LEN, MODEL, encode, gateway_harness, token_text

pytestmark = pytest.mark.anyio

TEXT = "The lighthouse keeper woke before dawn."


async def test_a_prompt_is_tokenized_as_a_completion_prompt() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/tokenize", json={"model": MODEL, "prompt": TEXT, "return_token_strs": True})
        plain = await h.http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False})
    ids = [BOS_ID, *encode(TEXT)]
    assert response.json() == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": [token_text(token) for token in ids],
    }
    assert plain.json()["tokens"] == encode(TEXT)  # the model named by default: the fleet serves one


async def test_messages_are_rendered_by_the_chat_template_and_tokenized_as_chat_does() -> None:
    messages = [{"role": "user", "content": TEXT}]
    async with gateway_harness() as h:
        tokenized = await h.http.post("/tokenize", json={"model": MODEL, "messages": messages})
        await h.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
        (request,) = h.worker.requests
        closed = await h.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert tokenized.json()["tokens"] == request.prompt_token_ids
    assert len(closed.json()["tokens"]) < tokenized.json()["count"]


async def test_detokenize_gives_back_the_text() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/detokenize", json={"model": MODEL, "tokens": encode(TEXT)})
        outside = await h.http.post("/detokenize", json={"model": MODEL, "tokens": [1, 100_000]})
    assert response.json() == {"prompt": TEXT}
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "a", "continue_final_message": True}, 400, "continue_final_message"),
        ({"model": "no-such-model", "prompt": "a"}, 404, "model"),
    ],
    ids=["neither", "both", "unknown-field", "unknown-model"],
)
async def test_bad_tokenize_bodies_name_their_field(body: dict[str, object], status: int, param: str) -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/tokenize", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


async def test_tokenize_checks_the_api_key() -> None:
    async with gateway_harness(api_keys={"sk-a": "tenant-a"}) as h:
        refused = await h.http.post("/tokenize", json={"prompt": TEXT})
        allowed = await h.http.post("/tokenize", json={"prompt": TEXT}, headers={"Authorization": "Bearer sk-a"})
    assert refused.status_code == 401 and allowed.status_code == 200
