"""Content parts and ``chat_template_kwargs``: text is served, everything else is a 400 naming the
message, the part and its type (chat, Responses and batch lines alike), never dropped; template
variables the server fills cannot be replaced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from metrale.batch.runner import BatchRun
from metrale.gateway.batches.objects import BatchStatus
from metrale.text.chat_templates.render import SERVER_VARIABLES
from tests.batch.test_runner import KEYS, A, chat_line, gateway, jsonl, submit
from tests.gateway.harness import MODEL, gateway_harness

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
PARTS = {
    "image_url": ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "images are"),
    "input_audio": ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio is"),
    "file": ({"type": "file", "file": {"file_id": "file-1"}}, "files are"),
    "video_url": ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "videos are"),
    "hologram": ({"type": "hologram", "hologram": {}}, "no content part type this server knows"),
    "refusal": ({"type": "refusal", "refusal": "no"}, "no content part type this server knows"),
}


def chat(content: Any, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


def error_of(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    found: dict[str, Any] = response.json()["error"]
    return found


@pytest.mark.parametrize("part_type", sorted(PARTS))
async def test_a_part_that_is_not_text_is_refused_naming_message_part_and_type(part_type: str) -> None:
    part, why = PARTS[part_type]
    async with gateway_harness() as h:
        response = await h.http.post(CHAT, json=chat([{"type": "text", "text": "What is this?"}, part]))
        assert h.worker.requests == []
    error = error_of(response)
    assert error["param"] == "messages[1].content[1].type"
    assert error["message"].startswith(f"messages[1].content[1] is a {part_type!r} part: {why}")
    assert "not served" in error["message"] or why.startswith("no content part")


async def test_text_parts_of_every_text_type_are_served_as_text() -> None:
    parts = [{"type": kind, "text": f"<{kind}>"} for kind in ("text", "input_text", "output_text")]
    async with gateway_harness() as h:
        served = await h.http.post(CHAT, json=chat(parts))
        as_string = await h.http.post(CHAT, json=chat("<text><input_text><output_text>"))
        first, second = h.worker.requests
    assert served.status_code == 200, served.text
    assert as_string.status_code == 200, as_string.text
    assert first.prompt_token_ids == second.prompt_token_ids  # nothing dropped


async def test_a_text_part_without_text_is_refused() -> None:
    async with gateway_harness() as h:
        response = await h.http.post(CHAT, json=chat([{"type": "text"}]))
    assert error_of(response)["param"] == "messages[1].content[0].text"


@pytest.mark.parametrize("key", sorted(SERVER_VARIABLES))
async def test_template_kwargs_the_server_fills_are_refused_naming_them(key: str) -> None:
    async with gateway_harness() as h:
        response = await h.http.post(CHAT, json=chat("Hi", chat_template_kwargs={"enable_thinking": True, key: "x"}))
        assert h.worker.requests == []
    error = error_of(response)
    assert error["param"] == f"chat_template_kwargs.{key}"
    assert f"chat_template_kwargs may not set {key!r}" in error["message"]


async def test_other_template_kwargs_reach_the_template() -> None:
    async with gateway_harness() as h:
        plain = await h.http.post(CHAT, json=chat("Hi"))
        thinking = await h.http.post(CHAT, json=chat("Hi", chat_template_kwargs={"enable_thinking": False}))
        documents = await h.http.post(CHAT, json=chat("Hi", chat_template_kwargs={"documents": [{"text": "d"}]}))
    assert plain.status_code == thinking.status_code == documents.status_code == 200


@pytest.mark.parametrize(
    ("part", "named"),
    [
        pytest.param({"type": "input_image", "image_url": "https://example.com/a.png"}, "images are", id="image"),
        pytest.param({"type": "input_file", "file_id": "file-1"}, "files are", id="file"),
        pytest.param({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "audio is", id="audio"),
        pytest.param({"type": "hologram"}, "no content part type", id="unknown"),
    ],
)
async def test_responses_parts_that_are_not_text_are_refused(part: dict[str, Any], named: str) -> None:
    content = [{"type": "input_text", "text": "What is this?"}, part]
    body = {"model": MODEL, "input": [{"role": "user", "content": content}], "max_output_tokens": 4}
    async with gateway_harness() as h:
        response = await h.http.post("/v1/responses", json=body)
    error = error_of(response)
    assert error["param"] == "input[0].content[1].type"
    assert error["message"].startswith(f"input[0].content[1] is a {part['type']!r} part: {named}")


async def test_responses_takes_no_chat_template_kwargs() -> None:
    body = {"model": MODEL, "input": "Hi", "chat_template_kwargs": {"bos_token": "x"}}
    async with gateway_harness() as h:
        response = await h.http.post("/v1/responses", json=body)
    assert "chat_template_kwargs" in error_of(response)["message"]


async def test_batch_lines_with_such_parts_or_kwargs_fail_naming_them(tmp_path: Path) -> None:
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    lines = [
        chat_line("ok", "hi"),
        {
            **chat_line("img", "x"),
            "body": {**chat_line("img", "x")["body"], "messages": [{"role": "user", "content": image}]},
        },
        chat_line("kw", "hi", chat_template_kwargs={"messages": []}),
    ]
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path) as h:
        batch_id = await submit(h, jsonl(lines))
        assert await BatchRun(gateway(h), "tenant-a", batch_id, window=2).run() is BatchStatus.FAILED
        errors = (await h.http.get(f"/v1/batches/{batch_id}", headers=A)).json()["errors"]["data"]
    assert [(e["line"], e["param"]) for e in errors] == [
        (2, "messages[0].content[0].type"),
        (3, "chat_template_kwargs.messages"),
    ]
    assert json.dumps(errors).count("image_url") >= 1
