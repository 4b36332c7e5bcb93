"""The tokenizers of models that write each tool-call format, shared by the grammar tests."""

from __future__ import annotations

import pytest

from metrale.text.tiktoken_vocab.kimi_writer import write_kimi_tokenizer
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import HERMES, KIMI_K2, QWEN3_CODER
from metrale.worker.model.builtin import builtin_model_dir
from tests.text.qwen_shaped import write_qwen_shaped_model


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("kimi-tokenizer")
    write_kimi_tokenizer(directory)
    return Tokenizer.from_dir(directory)


@pytest.fixture(scope="module")
def builtin_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(builtin_model_dir())


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_qwen_shaped_model(tmp_path_factory.mktemp("qwen") / "model"))


@pytest.fixture(scope="module")
def tokenizers(
    kimi_tokenizer: Tokenizer, builtin_tokenizer: Tokenizer, qwen_tokenizer: Tokenizer
) -> dict[str, Tokenizer]:
    """The tokenizer of a model that writes each format (its markers special tokens, text, or added tokens)."""
    return {KIMI_K2.name: kimi_tokenizer, HERMES.name: builtin_tokenizer, QWEN3_CODER.name: qwen_tokenizer}
