"""Structured outputs through the official ``openai`` client against real ``met`` processes on a real
Redis, on random-weight models: 50 of 50 seeded ``json_schema`` chats with ``n=2`` on the
release-shaped tiny model (Kimi template, tiktoken tokenizer) parse and validate, a stream reassembles
to the same answer, and a worker killed with SIGKILL mid-stream leaves every constrained stream
token-identical to an undisturbed run (the grammar's matcher is rebuilt by replay where it continues).

The schema bounds every string, number and array, so that every sentence of it is shorter than
``max_tokens`` whatever tokens a random model prefers: an unbounded string could run to the limit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch

from metrale.text.grammars import json_schema_grammar
from metrale.worker.engine.factory import LoadedModel
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.release_layout import write_release_model
from tests.failover.clients import EventTap, delivered, kill_busiest_worker_when
from tests.failover.local_fleet import MODEL, LocalFleet
from tests.failover.processes import RedisServer

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "keeper": {"type": "string", "maxLength": 12},
        "steps": {"type": "integer", "minimum": 0, "maximum": 999},
        "lamp": {"enum": ["on", "off"]},
        "logs": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["keeper", "steps", "lamp", "logs"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "lighthouse", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 160  # every sentence of SCHEMA is shorter, whatever its tokens
REQUESTS = 50
STREAMS = 12
KILL_AFTER_TOKENS = 120


@pytest.fixture
def release_fleet(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> Iterator[LocalFleet]:
    model_dir = write_release_model(tmp_path_factory.mktemp("release"), seed=7)
    # 50 requests of n 2 at once, without retries: admission control, which from the first request
    # plans a cold worker's steps pessimistically, is not what this test is about.
    fleet = LocalFleet(redis_server.url, model_dir, tmp_path, MET_MAX_QUEUE_WAIT_S="120")
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def tiny_fleet(redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalFleet]:
    fleet = LocalFleet(redis_server.url, tiny_model_dir, tmp_path)
    try:
        yield fleet
    finally:
        fleet.close()


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_fifty_seeded_json_schema_chats_with_n_2_all_validate(release_fleet: LocalFleet) -> None:
    release_fleet.start(["worker-1"])
    client = openai.AsyncOpenAI(base_url=f"{release_fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def ask(seed: int) -> Any:
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe lighthouse number {seed} as JSON."}],
            response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            n=2,
        )

    async def ask_all() -> list[Any]:
        try:
            return await asyncio.gather(*(ask(seed) for seed in range(REQUESTS)))
        finally:
            await client.close()

    answers = asyncio.run(ask_all())
    choices = [choice for answer in answers for choice in answer.choices]
    assert len(choices) == 2 * REQUESTS
    invalid = [c.message.content for c in choices if c.finish_reason != "stop" or not valid(c.message.content or "")]
    assert not invalid, f"{len(invalid)} of {len(choices)} outputs do not validate: {invalid[:3]}"
    assert len({c.message.content for c in choices}) > 10  # a random model with strong habits, yet seeds matter

    sync_client = openai.OpenAI(base_url=f"{release_fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    stream = sync_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe lighthouse number 3 as JSON."}],
        response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
        n=2,
        stream=True,
    )
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in answers[3].choices}
    sync_client.close()


def test_a_worker_killed_mid_stream_leaves_every_constrained_stream_token_identical(
    tiny_fleet: LocalFleet, redis_server: RedisServer, reference_model: LoadedModel
) -> None:
    tiny_fleet.start(["worker-1", "worker-2"])
    # Whole characters: a prompt ending inside a UTF-8 sequence would prefix the JSON with U+FFFD.
    prompts = [reference_model.tokenizer.encode(f"Logbook of lighthouse {i}, as JSON: ") for i in range(STREAMS)]
    tap = EventTap(redis_server.url, tiny_fleet.keys)
    killer = kill_busiest_worker_when(tap, KILL_AFTER_TOKENS, tiny_fleet)
    client = openai.AsyncOpenAI(base_url=f"{tiny_fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def stream(index: int) -> tuple[str, str, str | None]:
        chunks = await client.completions.create(
            model=MODEL,
            prompt=prompts[index],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=500 + index,
            stream=True,
            extra_body={"response_format": RESPONSE_FORMAT},
        )
        text, request_id, reason = "", "", None
        async for chunk in chunks:
            request_id = chunk.id
            text += chunk.choices[0].text if chunk.choices else ""
            reason = (chunk.choices[0].finish_reason if chunk.choices else None) or reason
        return request_id, text, reason

    async def stream_all() -> list[tuple[str, str, str | None]]:
        try:
            return await asyncio.gather(*(stream(i) for i in range(STREAMS)))
        finally:
            await client.close()

    streams = asyncio.run(stream_all())
    killer.join(1)
    tap.close()
    assert [name for name, worker in tiny_fleet.workers.items() if not worker.running], tiny_fleet.logs()
    expected = _undisturbed(reference_model, prompts)
    heard = tap.snapshot()
    moved = 0
    for (request_id, text, reason), tokens in zip(streams, expected, strict=True):
        events = delivered(heard[request_id])
        assert [t for e in events for t in e.token_ids] == tokens, request_id
        assert reason == "stop" and valid(text), text
        moved += len({e.worker_id for e in events}) > 1
    assert moved >= 1, "no constrained stream was continued by the other worker"


def _undisturbed(model: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """What each stream produces alone with its seed, on one thread as the workers run."""
    grammar = json_schema_grammar(SCHEMA)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=500 + i, grammar=grammar)
        for i in range(len(prompts))
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = model.engine.generate(prompts, params)
    finally:
        torch.set_num_threads(threads)
    return [result.completions[0].token_ids for result in results]
