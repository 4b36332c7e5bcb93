"""Prompt log-probabilities through a real ``met serve`` (``--dtype float32``) on a release-shaped tiny
model, against transformers 5.23 on the same folder: ``echo`` + ``logprobs`` on ``/v1/completions`` for
a string, a token-id list and lists of either (lm-evaluation-harness's loglikelihood request), and vLLM's
``prompt_logprobs`` on both completion endpoints — every prompt token within 2e-3 of transformers'."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from metrale.worker.model.release_layout import write_release_model
from tests.integration.deployments import API_KEY, Endpoint, serving_model
from tests.text.kimi_reference import transformers_tokenizer

TOLERANCE = 2e-3
TEXTS = [
    "The lighthouse keeper woke before dawn, as she had every morning for thirty years.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release_model(tmp_path_factory.mktemp("release-logprobs"), seed=11)


@pytest.fixture(scope="module")
def served(release_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    with serving_model(tmp_path_factory.mktemp("prompt-logprobs-serve"), release_dir, tenant="eval") as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def client(served: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(release_dir: Path) -> tuple[Any, Any]:
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(release_dir, dtype=torch.float32).eval()
    return transformers_tokenizer(release_dir, kimi_split=True), model


def transformers_logprobs(model: Any, ids: list[int]) -> list[float]:
    """Each prompt token's logprob after the tokens before it (from position 1), by transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))]


def token_ids(model: Any, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (length,), generator=generator).tolist()


def assert_close(got: list[float | None], expected: list[float]) -> None:
    assert got[0] is None
    assert len(got) == len(expected) + 1
    worst = max(abs(float(g) - e) for g, e in zip(got[1:], expected, strict=True))  # type: ignore[arg-type]
    assert worst <= TOLERANCE, worst


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS, ids=["english", "code"])
def test_echo_logprobs_of_a_text_prompt_equal_transformers(
    client: openai.OpenAI, served: Endpoint, reference: tuple[Any, Any], text: str
) -> None:
    tokenizer, model = reference
    ids = tokenizer(text)["input_ids"]
    answer = client.completions.create(model=served.model, prompt=text, echo=True, logprobs=1, max_tokens=0)
    (choice,) = answer.choices
    assert choice.text == text and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert_close(list(choice.logprobs.token_logprobs), transformers_logprobs(model, ids))


@pytest.mark.slow
def test_echo_logprobs_of_token_id_prompts_and_lists_equal_transformers(
    client: openai.OpenAI, served: Endpoint, reference: tuple[Any, Any]
) -> None:
    tokenizer, model = reference
    prompts = [token_ids(model, length, seed) for length, seed in ((4, 1), (37, 2), (70, 3))]
    single = client.completions.create(model=served.model, prompt=prompts[1], echo=True, logprobs=2, max_tokens=1)
    assert single.choices[0].logprobs is not None
    logprobs = list(single.choices[0].logprobs.token_logprobs or [])
    assert_close(logprobs[:-1], transformers_logprobs(model, prompts[1]))  # the last: the generated token
    # lm-evaluation-harness's loglikelihood request: token-id prompts in a list, echo, max_tokens 0
    body = {"model": served.model, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}
    listed = httpx.post(f"{served.base_url}/v1/completions", json=body, headers=served.headers, timeout=300).json()
    assert [choice["index"] for choice in listed["choices"]] == [0, 1, 2]
    for prompt, choice in zip(prompts, listed["choices"], strict=True):
        assert_close(choice["logprobs"]["token_logprobs"], transformers_logprobs(model, prompt))
        assert choice["logprobs"]["top_logprobs"][0] is None
    texts = client.completions.create(model=served.model, prompt=TEXTS, echo=True, logprobs=0, max_tokens=0)
    for text, choice in zip(TEXTS, texts.choices, strict=True):
        assert choice.logprobs is not None
        expected = transformers_logprobs(model, tokenizer(text)["input_ids"])
        assert_close(list(choice.logprobs.token_logprobs or []), expected)


@pytest.mark.slow
def test_vllm_prompt_logprobs_on_both_endpoints_equal_transformers(
    served: Endpoint, reference: tuple[Any, Any]
) -> None:
    tokenizer, model = reference
    ids = token_ids(model, 25, seed=4)
    body = {"model": served.model, "prompt": ids, "prompt_logprobs": 3, "max_tokens": 1}
    answer = httpx.post(f"{served.base_url}/v1/completions", json=body, headers=served.headers, timeout=300).json()
    entries = answer["choices"][0]["prompt_logprobs"]
    assert entries[0] is None
    got = [entries[p][str(ids[p])]["logprob"] for p in range(1, len(ids))]
    assert_close([None, *got], transformers_logprobs(model, ids))
    assert all(len(entry) >= 3 for entry in entries[1:])
    messages = [{"role": "user", "content": "Which steps does the keeper climb?"}]
    chat_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(chat_text, add_special_tokens=False)["input_ids"]
    body = {"model": served.model, "messages": messages, "prompt_logprobs": 0, "max_tokens": 1}
    chat = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, headers=served.headers, timeout=300).json()
    entries = chat["prompt_logprobs"]
    got = [entries[p][str(chat_ids[p])]["logprob"] for p in range(1, len(chat_ids))]
    assert_close([None, *got], transformers_logprobs(model, chat_ids))
