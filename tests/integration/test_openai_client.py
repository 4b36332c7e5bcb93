"""The official ``openai`` client, unmodified (only ``base_url`` and ``api_key``), against ``met serve``
(embedded Redis) and against ``met gateway`` + ``met worker`` on the real Redis.

Every answer is checked against the offline engine on the same model: sampling is seeded per request
and position, so a seeded request must produce exactly the offline choices, token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from metrale.worker.engine.factory import LoadedModel
from metrale.worker.engine.request import Completion
from metrale.worker.engine.sampling_params import SamplingParams
from tests.integration.deployments import Endpoint, Fleet, running_serve
from tests.integration.reference import offline_choices, token_texts, visible_text

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You keep the lighthouse."},
    {"role": "user", "content": "Is the lamp lit tonight?"},
]
PROMPT = "Once upon a time, the keeper"
MAX_TOKENS = 24
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("serve", id="met-serve"),
        pytest.param("fleet", id="gateway-worker-redis", marks=pytest.mark.redis),
    ],
)
def endpoint(
    request: pytest.FixtureRequest, integration_dir: Path, model_settings: dict[str, str]
) -> Iterator[Endpoint]:
    """Where the client connects: ``met serve`` (started here) or the package's fleet."""
    if request.param == "fleet":
        fleet: Fleet = request.getfixturevalue("fleet")
        yield fleet.endpoint
        return
    with running_serve(integration_dir, settings=model_settings) as served:
        yield served


@pytest.fixture
def client(endpoint: Endpoint) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{endpoint.base_url}/v1", api_key=endpoint.api_key, max_retries=0, timeout=60)
    yield client
    client.close()


def offline(model: LoadedModel, prompt_ids: list[int], *, seed: int, logprobs: int | None = None) -> list[Completion]:
    """The two seeded choices the fleet must produce; distinct, so a swapped choice would show."""
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=seed, n=2, logprobs=logprobs)
    choices = offline_choices(model, prompt_ids, params)
    assert choices[0].token_ids != choices[1].token_ids, "pick another seed: the choices must differ"
    return choices


def chat_prompt_ids(model: LoadedModel) -> list[int]:
    return model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)


def test_chat_completion_with_logprobs(client: openai.OpenAI, endpoint: Endpoint, reference_model: LoadedModel) -> None:
    completion = client.chat.completions.create(
        model=endpoint.model, messages=MESSAGES, max_tokens=MAX_TOKENS, n=2, seed=11, logprobs=True, top_logprobs=2
    )

    prompt_ids = chat_prompt_ids(reference_model)
    expected = offline(reference_model, prompt_ids, seed=11, logprobs=2)
    assert [choice.index for choice in completion.choices] == [0, 1]
    for choice, want in zip(completion.choices, expected, strict=True):
        assert choice.message.content == visible_text(reference_model, want)
        assert want.finish_reason is not None and choice.finish_reason == want.finish_reason.value
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
        assert [entry.token for entry in entries] == token_texts(reference_model, want.token_ids)
        assert [entry.logprob for entry in entries] == pytest.approx(want.logprobs, abs=LOGPROB_TOLERANCE)
        for entry, alternatives in zip(entries, want.top_logprobs, strict=True):
            alternative_ids, alternative_logprobs = zip(*alternatives, strict=True)
            assert [top.token for top in entry.top_logprobs] == token_texts(reference_model, alternative_ids)
            assert [top.logprob for top in entry.top_logprobs] == pytest.approx(
                list(alternative_logprobs), abs=LOGPROB_TOLERANCE
            )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.usage.completion_tokens == sum(len(want.token_ids) for want in expected)


def test_streamed_chat_completion_with_usage(
    client: openai.OpenAI, endpoint: Endpoint, reference_model: LoadedModel
) -> None:
    stream = client.chat.completions.create(
        model=endpoint.model,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        n=2,
        seed=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)

    prompt_ids = chat_prompt_ids(reference_model)
    expected = offline(reference_model, prompt_ids, seed=12)
    assert len({chunk.id for chunk in chunks}) == 1
    for index, want in enumerate(expected):
        assert "".join(_chat_deltas(chunks, index)) == visible_text(reference_model, want)
        assert want.finish_reason is not None and _finish_reasons(chunks, index) == [want.finish_reason.value]
    *deltas, last = chunks
    assert all(chunk.usage is None for chunk in deltas) and last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == sum(len(want.token_ids) for want in expected)


def test_text_completion_with_logprobs(client: openai.OpenAI, endpoint: Endpoint, reference_model: LoadedModel) -> None:
    completion = client.completions.create(
        model=endpoint.model, prompt=PROMPT, max_tokens=MAX_TOKENS, n=2, seed=13, logprobs=2
    )

    prompt_ids = reference_model.tokenizer.encode(PROMPT, add_special_tokens=True)  # BOS, as OpenAI's servers do
    expected = offline(reference_model, prompt_ids, seed=13, logprobs=2)
    for choice, want in zip(completion.choices, expected, strict=True):
        assert choice.text == visible_text(reference_model, want)
        assert want.finish_reason is not None and choice.finish_reason == want.finish_reason.value
        assert choice.logprobs is not None
        assert choice.logprobs.tokens == token_texts(reference_model, want.token_ids)
        assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=LOGPROB_TOLERANCE)
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        len(prompt_ids),
        sum(len(want.token_ids) for want in expected),
    )


def test_streamed_text_completion_of_token_ids_with_usage(
    client: openai.OpenAI, endpoint: Endpoint, reference_model: LoadedModel
) -> None:
    prompt_ids = reference_model.tokenizer.encode(PROMPT)
    stream = client.completions.create(
        model=endpoint.model,
        prompt=prompt_ids,
        max_tokens=MAX_TOKENS,
        n=2,
        seed=14,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)

    expected = offline(reference_model, prompt_ids, seed=14, logprobs=0)
    for index, want in enumerate(expected):
        mine = [choice for chunk in chunks for choice in chunk.choices if choice.index == index]
        assert "".join(choice.text for choice in mine) == visible_text(reference_model, want)
        tokens = [token for choice in mine if choice.logprobs for token in choice.logprobs.tokens or []]
        assert tokens == token_texts(reference_model, want.token_ids)
        assert want.finish_reason is not None
        assert [choice.finish_reason for choice in mine if choice.finish_reason] == [want.finish_reason.value]
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == sum(len(want.token_ids) for want in expected)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_a_logit_bias_of_100_at_temperature_0_makes_that_token_the_output(
    client: openai.OpenAI, endpoint: Endpoint, reference_model: LoadedModel
) -> None:
    prompt_ids = reference_model.tokenizer.encode(PROMPT, add_special_tokens=True)
    [unbiased] = offline_choices(reference_model, prompt_ids, SamplingParams(max_tokens=6, temperature=0.0))
    favoured = next(t for t in range(100, 200) if t not in unbiased.token_ids)
    completion = client.completions.create(
        model=endpoint.model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        logit_bias={str(favoured): 100},
    )
    (choice,) = completion.choices
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == token_texts(reference_model, [favoured] * 6)
    assert choice.finish_reason == "length"


def test_a_wrong_api_key_is_refused(endpoint: Endpoint) -> None:
    intruder = openai.OpenAI(base_url=f"{endpoint.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with intruder, pytest.raises(openai.AuthenticationError):
        intruder.completions.create(model=endpoint.model, prompt=PROMPT, max_tokens=2)


def _chat_deltas(chunks: list[ChatCompletionChunk], index: int) -> list[str]:
    return [choice.delta.content or "" for chunk in chunks for choice in chunk.choices if choice.index == index]


def _finish_reasons(chunks: list[ChatCompletionChunk], index: int) -> list[str]:
    return [
        str(choice.finish_reason)
        for chunk in chunks
        for choice in chunk.choices
        if choice.index == index and choice.finish_reason is not None
    ]
