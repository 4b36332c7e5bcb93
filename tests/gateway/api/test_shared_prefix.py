"""Fifty chats sharing a long system prompt: after the first, every one resumes from its checkpoint."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import pytest
import redis.asyncio

from metrale.gateway.app import create_app
from tests.gateway.api.test_sessions import MODEL, WORDS, Fleet

pytestmark = pytest.mark.anyio

SYSTEM_PROMPT = " ".join(WORDS[i % len(WORDS)] + str(i % 7) for i in range(620))


@pytest.mark.redis
@pytest.mark.slow
async def test_fifty_requests_share_the_system_prompt_checkpoint(real_redis_url: str, tiny_model_dir: Path) -> None:
    fleet = Fleet(real_redis_url, tiny_model_dir, checkpoints=True)
    client = redis.asyncio.Redis.from_url(real_redis_url)
    # Admission may not shed the 49 at once: it cannot know they resume from one checkpoint, and on a slow
    # machine it prices 49 whole prompts past the default bound. This test is about the sharing.
    settings = dataclasses.replace(fleet.gateway_settings(), max_queue_wait_s=600)
    app = create_app(settings, client)

    async def ask(http: httpx.AsyncClient, i: int) -> dict[str, int]:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"Entry {i}?"}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        return {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}

    try:
        with fleet.worker("worker-a"):
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=120
                ) as http,
            ):
                first = await ask(http, 0)
                rest = await asyncio.gather(*(ask(http, i) for i in range(1, 50)))
    finally:
        await client.aclose()
        fleet.close()
    assert first["prompt"] > 1000 and first["cached"] == 0
    system_tokens = {r["cached"] for r in rest}
    assert len(system_tokens) == 1, system_tokens  # every one resumed at the end of the system prompt
    [cached] = system_tokens
    assert 1000 < cached < first["prompt"]
