"""Fixtures the tool-calling tests of the API share."""

from __future__ import annotations

import pytest

from metrale.shared.messages import ModelAnnouncement
from metrale.text.tiktoken_vocab.kimi_writer import write_kimi_tokenizer
from metrale.text.tokenizer import Tokenizer
from metrale.worker.fleet.announcement import tokenizer_config_text
from tests.gateway.harness import MODEL


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelAnnouncement, Tokenizer]:
    """A release-shaped Kimi tokenizer (tiktoken folder, Kimi's template), announced as ``MODEL``."""
    directory = tmp_path_factory.mktemp("kimi")
    write_kimi_tokenizer(directory)
    tokenizer = Tokenizer.from_dir(directory)
    announced = ModelAnnouncement(
        model=MODEL,
        tokenizer_json=tokenizer.backend_json(),
        tokenizer_config_json=tokenizer_config_text(directory),
        max_model_len=4096,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        fingerprint="cd" * 32,
    )
    return announced, tokenizer
