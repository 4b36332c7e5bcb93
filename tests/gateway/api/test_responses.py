"""``/v1/responses`` through the official ``openai`` client (unmodified, over ASGI), with real workers on a
real Redis (one, and a Redis Cluster): a conversation by ``previous_response_id`` is fed exactly the tokens
it produced, equals an offline run fed the same ids from 0, resumes every turn past all of the previous one
on whichever worker serves it; stored responses are per tenant, and bad continuations get clear errors."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import jsonschema
import openai
import pytest
import redis.asyncio
from transformers import AutoTokenizer

from metrale.gateway.app import create_app
from metrale.shared.record import read_record
from metrale.shared.redis_connect import connect_async
from metrale.shared.sessions import Transcript
from metrale.shared.settings import GatewaySettings
from metrale.worker.engine.factory import EngineLimits, LoadedModel, build_engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.builtin import builtin_model_dir
from tests.gateway.api.test_session_cache import QUESTIONS
from tests.gateway.api.test_sessions import MODEL, Fleet

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.slow]

INSTRUCTIONS = "You keep a lighthouse log."
MAX_OUTPUT_TOKENS = 20
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
RESPONSE_TTL_S = 600


@pytest.fixture(params=["tiny-random"])
def model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Path:
    """The random-weight tiny model, or (parametrized indirectly) the built-in one, whose replies end
    on the template's end-of-turn token."""
    return builtin_model_dir() if request.param == "builtin" else tiny_model_dir


@pytest.fixture
def fleet(any_redis_url: str, model_dir: Path) -> Iterator[Fleet]:
    fleet = Fleet(any_redis_url, model_dir, checkpoints=True)
    yield fleet
    fleet.close()


@pytest.fixture
def reference(model_dir: Path) -> LoadedModel:
    return build_engine(model_dir, EngineLimits(max_seqs=4, num_blocks=512))


@contextlib.asynccontextmanager
async def clients(fleet: Fleet) -> AsyncIterator[tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]]:
    """The official client for tenant a and for tenant b, talking to one in-process gateway."""
    client = cast(redis.asyncio.Redis, connect_async(fleet.redis_url))  # a cluster's answers the same calls
    settings = dataclasses.replace(fleet.gateway_settings(), api_keys=KEYS, response_ttl_s=RESPONSE_TTL_S)
    assert isinstance(settings, GatewaySettings)
    app = create_app(settings, client)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, timeout=120) as http:
        made = [
            openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key, http_client=http, max_retries=0)
            for key in KEYS
        ]
        yield made[0], made[1]
    await client.aclose()


def stored_transcript(fleet: Fleet, response_id: str) -> Transcript:
    raw = fleet.sync.hgetall(fleet.keys.response("tenant-a", response_id))
    transcript = Transcript.from_fields(raw)
    assert transcript is not None
    return transcript


def offline_reply(reference: LoadedModel, prompt_ids: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=MAX_OUTPUT_TOKENS, temperature=0.0)
    (result,) = reference.engine.generate([prompt_ids], params)
    return list(result.completions[0].token_ids)


@pytest.mark.parametrize(
    ("model_dir", "workers"),
    [("tiny-random", "one"), ("tiny-random", "alternating"), ("builtin", "alternating")],
    indirect=["model_dir"],
)
async def test_a_conversation_continues_from_its_exact_tokens(
    fleet: Fleet, reference: LoadedModel, model_dir: Path, workers: str
) -> None:
    names = ["worker-a"] if workers == "one" else ["worker-a", "worker-b"]
    previous_id: str | None = None
    previous_total = 0
    previous_transcript: tuple[int, ...] = ()
    served_by = []
    async with clients(fleet) as (client, _):
        for turn, question in enumerate(QUESTIONS):
            with fleet.worker(names[turn % len(names)]):
                response = await client.responses.create(
                    model=MODEL,
                    input=question,
                    instructions=INSTRUCTIONS if previous_id is None else openai.omit,
                    previous_response_id=previous_id if previous_id is not None else openai.omit,
                    max_output_tokens=MAX_OUTPUT_TOKENS,
                    temperature=0.0,
                )
            assert response.status in ("completed", "incomplete")
            assert response.usage is not None
            transcript = stored_transcript(fleet, response.id)
            prompt = list(transcript.token_ids[: transcript.prompt_length])
            reply = list(transcript.token_ids[transcript.prompt_length :])
            if turn == 0:
                tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
                messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                # Exactly the tokens of the previous turn as consumed and generated, then the new ones.
                assert tuple(prompt[: len(previous_transcript)]) == previous_transcript
                cached = response.usage.input_tokens_details.cached_tokens
                assert cached >= previous_total, f"turn {turn + 1}: {cached} cached of {previous_total}"
            record = read_record(fleet.sync, response.id, keys=fleet.keys)
            assert record is not None
            served_by.append(record.worker_id)
            assert [t for event in record.events for t in event.token_ids] == reply
            assert reply == offline_reply(reference, prompt), f"turn {turn + 1} differs from a run from 0"
            assert response.output_text == reference.tokenizer.decode(reply)
            assert response.usage.input_tokens == len(prompt)
            assert response.usage.output_tokens == len(reply)
            previous_id, previous_total = response.id, response.usage.total_tokens
            previous_transcript = transcript.token_ids
    assert served_by == [names[turn % len(names)] for turn in range(len(QUESTIONS))]


async def test_streamed_retrieved_listed_deleted(fleet: Fleet) -> None:
    async with clients(fleet) as (client, other):
        with fleet.worker("worker-a"):
            stream = await client.responses.create(
                model=MODEL,
                input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there."}]}],
                instructions=INSTRUCTIONS,
                max_output_tokens=8,
                temperature=0.0,
                stream=True,
            )
            events = [event async for event in stream]
            whole = await client.responses.create(
                model=MODEL, input="Hello there.", instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0.0
            )
        kinds = [event.type for event in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        assert [event.sequence_number for event in events] == list(range(len(events)))
        deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
        final = events[-1].response  # type: ignore[union-attr]
        assert final.output_text == deltas == whole.output_text
        assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
        assert final.usage is not None and final.usage.output_tokens == 8

        assert 0 < fleet.sync.ttl(fleet.keys.response("tenant-a", final.id)) <= RESPONSE_TTL_S
        retrieved = await client.responses.retrieve(final.id)
        assert retrieved.output_text == deltas and retrieved.id == final.id
        items = await client.responses.input_items.list(final.id)
        assert [(item.type, item.role) for item in items.data] == [("message", "user")]  # type: ignore[union-attr]
        assert items.data[0].content[0].text == "Hello there."  # type: ignore[union-attr]

        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(final.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.create(model=MODEL, input="Hi", previous_response_id=final.id)
        with pytest.raises(openai.BadRequestError, match="background"):
            await client.responses.cancel(final.id)
        await client.responses.delete(final.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(final.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=MODEL, input="Hi", previous_response_id=final.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(final.id)


async def test_bad_continuations_and_refused_parameters(fleet: Fleet) -> None:
    async with clients(fleet) as (client, _):
        with fleet.worker("worker-a"):
            unstored = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
            with pytest.raises(openai.NotFoundError, match="not found"):
                await client.responses.create(model=MODEL, input="Hi", previous_response_id="resp-unknown")
            with pytest.raises(openai.BadRequestError, match="store") as refused:
                await client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)
            assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(unstored.id)
            with pytest.raises(openai.BadRequestError, match="background") as no_background:
                await client.responses.create(model=MODEL, input="Hi", background=True, store=False)
            assert no_background.value.body["param"] == "background"  # type: ignore[index]


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
"""Every value is short, so a random model completes any sentence of its grammar within ``FORCED_TOKENS``."""
FORCED_TOKENS = 200
TOOL: Any = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}


def without_ids(response: openai.types.responses.Response) -> list[dict[str, Any]]:
    return [item.model_dump(exclude={"id", "call_id"}, exclude_none=True) for item in response.output]


async def test_a_tool_round_trip_on_the_model(fleet: Fleet) -> None:
    """A forced call (the worker masks logits with its grammar) whose arguments validate, streamed and
    whole alike; its result goes back by ``previous_response_id`` (from the call's exact tokens) and
    by replaying the input, and the model answers in text."""
    ask = {"model": MODEL, "input": "Weather in Paris?", "tools": [TOOL], "temperature": 0.0}
    forced = {**ask, "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": FORCED_TOKENS}
    async with clients(fleet) as (client, _):
        with fleet.worker("worker-a"):
            whole = await client.responses.create(**forced)
            stream = await client.responses.create(**forced, stream=True)
            streamed = [event async for event in stream][-1].response  # type: ignore[union-attr]
            call = whole.output[-1]
            assert isinstance(call, openai.types.responses.ResponseFunctionToolCall), whole.output
            result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
            final = {**ask, "tool_choice": "none", "max_output_tokens": 6}
            continued = await client.responses.create(**{**final, "input": [result]}, previous_response_id=whole.id)
            replay: Any = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), result]
            replayed = await client.responses.create(**{**final, "input": replay})
    assert whole.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert without_ids(streamed) == without_ids(whole)
    first = stored_transcript(fleet, whole.id)
    after = stored_transcript(fleet, continued.id)
    assert after.token_ids[: len(first.token_ids)] == first.token_ids
    for answer in (continued, replayed):
        assert [item.type for item in answer.output] == ["message"] and answer.output_text
        assert answer.usage is not None and answer.usage.output_tokens == 6


async def test_a_json_schema_text_format_constrains_the_output(fleet: Fleet) -> None:
    text: Any = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    async with clients(fleet) as (client, _):
        with fleet.worker("worker-a"):
            response = await client.responses.create(
                model=MODEL, input="Weather?", text=text, max_output_tokens=FORCED_TOKENS, temperature=0.0
            )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
