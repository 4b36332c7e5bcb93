from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from metrale.shared.codec import decode
from metrale.shared.messages import FinishReason, GenerateRequest, Priority
from metrale.shared.record import RunRecord, RunStatus, read_record_async
from metrale.text.builtin_tokenizer import IM_END_ID
from tests.gateway.fake_worker import FakeWorkerScript, fake_alternatives, fake_logprob
from tests.gateway.harness import (
    MAX_MODEL_LEN,
    MODEL,
    REPLY_TEXT,
    Harness,
    announcement,
    choice_text,
    encode,
    eventually,
    gateway_harness,
    reply_with_eos,
    sse_payloads,
    token_text,
)

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who keeps the light?"}]
CHATML_PROMPT = "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho keeps the light?<|im_end|>\n"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, **extra}


async def test_a_chat_is_answered_with_the_workers_tokens_as_text() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat())
        assert response.status_code == 200
        body = response.json()
        (request,) = h.worker.requests
    assert body["id"] == request.request_id and body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": REPLY_TEXT},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    completion_tokens = len(encode(REPLY_TEXT)) + 1  # the EOS is generated, though not shown
    prompt_tokens = len(request.prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_the_prompt_is_the_chat_template_rendering() -> None:
    async with gateway_harness() as h:
        await h.http.post("/v1/chat/completions", json=chat())
        (request,) = h.worker.requests
    tokenizer_text = encode(CHATML_PROMPT + "<|im_start|>assistant\n")
    assert request.prompt_token_ids == tokenizer_text
    assert request.model == MODEL and request.tenant == "default"
    assert request.max_tokens == MAX_MODEL_LEN - len(tokenizer_text)  # no limit given: the rest of the context


async def test_sampling_fields_and_extensions_reach_the_worker() -> None:
    fields = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "seed": 1234,
        "max_completion_tokens": 7,
        "stop_token_ids": [42],
        "priority": "batch",
        "session": "s-1",
        "user": "someone",
    }
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat(**fields))
        assert response.status_code == 200
        (request,) = h.worker.requests
    assert (request.temperature, request.top_p, request.top_k, request.min_p) == (0.7, 0.9, 5, 0.05)
    assert (request.presence_penalty, request.frequency_penalty, request.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (request.seed, request.max_tokens, request.stop_token_ids) == (1234, 7, [42])
    assert (request.priority, request.session_id) == (Priority.BATCH, "s-1")


async def test_the_session_header_is_passed_through() -> None:
    async with gateway_harness() as h:
        await h.http.post("/v1/chat/completions", json=chat(), headers={"X-Session-Id": "from-header"})
        await h.http.post("/v1/chat/completions", json=chat(session="from-body"), headers={"X-Session-Id": "x"})
        sessions = [request.session_id for request in h.worker.requests]
    assert sessions == ["from-header", "from-body"]


async def test_the_api_keys_tenant_goes_into_the_request() -> None:
    async with gateway_harness(api_keys={"sk-acme": "acme"}) as h:
        response = await h.http.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer sk-acme"})
        assert response.status_code == 200
        assert [request.tenant for request in h.worker.requests] == ["acme"]


async def test_a_stream_sends_role_then_content_then_done() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat(stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(response.text)
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks[1:]]
    assert all(set(delta) == {"content"} for delta in deltas)
    assert "".join(delta["content"] for delta in deltas) == REPLY_TEXT
    assert len(deltas) > 3  # streamed token by token, not in one piece
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[-1:]] == ["stop"]
    assert all(chunk["usage"] is None for chunk in chunks)


async def test_include_usage_adds_a_last_chunk_with_usage_only() -> None:
    async with gateway_harness(FakeWorkerScript(reply_with_eos, cached_tokens=4)) as h:
        response = await h.http.post(
            "/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True})
        )
        (request,) = h.worker.requests
    *_, last = sse_payloads(response.text)
    assert last["choices"] == []
    prompt_tokens = len(request.prompt_token_ids)
    completion_tokens = len(encode(REPLY_TEXT)) + 1
    assert last["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_n_choices_each_get_their_own_text_and_usage_sums_them(stream: bool) -> None:
    async with gateway_harness() as h:
        response = await h.http.post(
            "/v1/chat/completions", json=chat(n=3, stream=stream, stream_options={"include_usage": True})
        )
        (request,) = h.worker.requests
    assert request.n == 3
    texts, reasons, usage = read_choices(response, stream)
    assert texts == {index: choice_text(index) for index in range(3)}
    assert reasons == {0: "stop", 1: "stop", 2: "stop"}
    assert usage["prompt_tokens"] == len(request.prompt_token_ids)
    assert usage["completion_tokens"] == sum(len(encode(choice_text(index))) + 1 for index in range(3))


def read_choices(response: httpx.Response, stream: bool) -> tuple[dict[int, str], dict[int, str], dict[str, Any]]:
    """Each choice's text and finish reason, and the usage, from a whole or streamed chat response."""
    if not stream:
        body = response.json()
        choices = body["choices"]
        texts = {c["index"]: c["message"]["content"] for c in choices}
        return texts, {c["index"]: c["finish_reason"] for c in choices}, body["usage"]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = sse_payloads(response.text)
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"]["content"]
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    return texts, reasons, chunks[-1]["usage"]


async def test_max_tokens_ends_a_choice_with_length() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat(max_tokens=4))
    (choice,) = response.json()["choices"]
    reply = encode(REPLY_TEXT)
    assert choice["finish_reason"] == "length"
    assert encode(choice["message"]["content"]) == reply[:4]
    assert response.json()["usage"]["completion_tokens"] == 4


async def test_a_stop_token_id_ends_the_choice_and_its_text_is_not_shown() -> None:
    reply = encode(REPLY_TEXT)
    stop_id = reply[3]
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat(stop_token_ids=[stop_id]))
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "stop"
    assert encode(choice["message"]["content"]) == reply[:3]
    assert response.json()["usage"]["completion_tokens"] == 4


async def test_the_end_of_turn_token_is_never_shown() -> None:
    script = FakeWorkerScript(lambda request, index: [*encode("Done."), IM_END_ID])
    async with gateway_harness(script) as h:
        response = await h.http.post("/v1/chat/completions", json=chat())
    assert response.json()["choices"][0]["message"]["content"] == "Done."


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_stop_string_cuts_the_text_and_cancels_the_request(stream: bool) -> None:
    long_reply = encode(REPLY_TEXT * 3)
    script = FakeWorkerScript(lambda request, index: long_reply, step_s=0.01)
    async with gateway_harness(script) as h:
        response = await h.http.post("/v1/chat/completions", json=chat(stop=["keeper"], stream=stream))
        (request,) = h.worker.requests
        record = await _finished_record(h, request)
    texts, reasons, _ = read_choices(response, stream)
    assert texts == {0: "The lighthouse "}
    assert reasons == {0: "stop"}
    assert [(cancel.request_id, cancel.reason) for cancel in h.worker.cancels] == [
        (request.request_id, "stop string matched")
    ]
    assert record.finish_reason is FinishReason.ABORT  # the worker stopped early, as asked
    assert len(record.token_ids()) < len(long_reply)


async def test_chat_logprobs_come_in_the_chat_format() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2, max_tokens=3))
        (request,) = h.worker.requests
    assert request.logprobs == 2
    content = response.json()["choices"][0]["logprobs"]["content"]
    reply = encode(REPLY_TEXT)[:3]
    texts = [token_text(token) for token in reply]
    assert [entry["token"] for entry in content] == texts
    assert [entry["logprob"] for entry in content] == [fake_logprob(position) for position in range(3)]
    assert content[0]["bytes"] == list(texts[0].encode())
    vocab = announcement().vocab_size
    expected_top = [
        [(token_text(t), lp) for t, lp in fake_alternatives(token, position, 2, vocab)]
        for position, token in enumerate(reply)
    ]
    assert [[(alt["token"], alt["logprob"]) for alt in entry["top_logprobs"]] for entry in content] == expected_top


async def test_without_logprobs_the_worker_is_not_asked_for_them() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat(max_tokens=2))
        (request,) = h.worker.requests
    assert request.logprobs is None
    assert response.json()["choices"][0]["logprobs"] is None


async def test_streamed_logprobs_ride_on_their_chunks() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/chat/completions", json=chat(logprobs=True, max_tokens=3, stream=True))
    entries = [
        entry
        for chunk in sse_payloads(response.text)[1:]
        for entry in (chunk["choices"][0]["logprobs"] or {"content": []})["content"]
    ]
    assert [entry["logprob"] for entry in entries] == [fake_logprob(position) for position in range(3)]
    assert all(entry["top_logprobs"] == [] for entry in entries)


async def test_a_request_is_recorded_as_queued_and_put_on_its_stream() -> None:
    async with gateway_harness(worker_running=False) as h:
        stream = h.keys.request_stream(Priority.BATCH)
        sent = asyncio.create_task(h.http.post("/v1/chat/completions", json=chat(priority="batch")))

        async def queued() -> bool:
            return await h.redis.xlen(stream) == 1

        await eventually(queued)
        ((_, fields),) = await h.redis.xrange(stream)
        request = decode(fields[b"msg"])
        assert isinstance(request, GenerateRequest)
        record = await read_record_async(h.redis, request.request_id, keys=h.keys)
        sent.cancel()
    assert set(fields) == {b"msg"}
    assert record is not None and record.status is RunStatus.QUEUED and record.events == ()
    assert request.deadline is not None and request.deadline - request.created_at == pytest.approx(5.0)


async def _finished_record(h: Harness, request: GenerateRequest) -> RunRecord:
    async def finished() -> bool:
        record = await read_record_async(h.redis, request.request_id, keys=h.keys)
        return record is not None and record.status is RunStatus.FINISHED

    await eventually(finished)
    record = await read_record_async(h.redis, request.request_id, keys=h.keys)
    assert record is not None
    return record


async def test_a_developer_message_is_the_system_message_of_a_template_without_that_role() -> None:
    developer = [{"role": "developer", "content": "Be brief."}, MESSAGES[1]]
    async with gateway_harness() as h:
        as_developer = await h.http.post("/v1/chat/completions", json={"model": MODEL, "messages": developer})
        as_system = await h.http.post("/v1/chat/completions", json=chat())
        first, second = h.worker.requests
    assert (as_developer.status_code, as_system.status_code) == (200, 200)
    assert first.prompt_token_ids == second.prompt_token_ids == encode(CHATML_PROMPT + "<|im_start|>assistant\n")
    assert first.checkpoint_positions == second.checkpoint_positions != []  # the end of the system prompt
