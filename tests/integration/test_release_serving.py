"""``met serve --model DIR --dtype float32`` on a release-shaped tiny model (bf16 shards, the release's tensor
names, a Kimi tiktoken tokenizer and chat template), through the official ``openai`` client: the prompt
token counts and greedy continuations equal transformers' from the same folder, and chats are the
template's text.

transformers without the release's remote code splits text with tiktoken's cl100k pattern, not Kimi's
(``tests/text/tiktoken_vocab/test_tiktoken_tokenizer.py`` shows it); the reference tokenizer is transformers' own
loading of the folder with Kimi's split pattern, which is what the release's ``tokenization_kimi.py``
does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from metrale.worker.model.release_layout import write_release_model
from tests.integration.deployments import API_KEY, Endpoint, serving_model
from tests.text.kimi_reference import transformers_tokenizer

TEXTS = [
    "The lighthouse keeper woke before dawn, as she had every morning.",
    "中文abc混合English 123 — it's 3.14, DON'T worry 👋",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)",
]
CHAT = [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": "Which steps does the keeper climb? 九十二"},
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release_model(tmp_path_factory.mktemp("release"), seed=5)


@pytest.fixture(scope="module")
def served(release_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    with serving_model(tmp_path_factory.mktemp("release-serve"), release_dir, tenant="release") as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def client(served: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(release_dir: Path) -> tuple[Any, Any]:
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(release_dir, dtype=torch.float32).eval()
    return transformers_tokenizer(release_dir, kimi_split=True), model


def _greedy(model: Any, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]


@pytest.mark.parametrize("text", TEXTS, ids=["english", "mixed", "code"])
def test_a_text_prompt_is_counted_and_continued_as_transformers_does(
    client: openai.OpenAI, served: Endpoint, reference: tuple[Any, Any], text: str
) -> None:
    tokenizer, model = reference
    ids = tokenizer(text)["input_ids"]
    answer = client.completions.create(
        model=served.model,
        prompt=text,
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    expected = _greedy(model, ids)
    assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_a_chat_is_the_templates_text_and_continues_as_transformers_does(
    client: openai.OpenAI, served: Endpoint, reference: tuple[Any, Any]
) -> None:
    tokenizer, model = reference
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    answer = client.chat.completions.create(
        model=served.model,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    expected = _greedy(model, ids)
    assert answer.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
