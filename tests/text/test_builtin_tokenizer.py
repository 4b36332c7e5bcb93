from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from metrale.text.builtin_tokenizer import (
    BOS_ID,
    BOS_TOKEN,
    BPE_VOCAB_SIZE,
    BUILTIN_VOCAB_SIZE,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    write_builtin_tokenizer,
)
from metrale.text.chat_templates.render import ChatTemplateError, render_chat
from metrale.text.tokenizer import Tokenizer

SAMPLE_TEXTS = {
    "ascii": "The keeper wound the clock at 06:00.",
    "whitespace": "  two  spaces\n\ttab\r\nCRLF   ",
    "accents": "Café crème, naïve façade, Ångström",
    "cjk": "灯塔看守人 在黎明前醒来",
    "emoji": "ships 🚢⚓ and a family 👨‍👩‍👧 👍🏽",
    "special-markers": "<|im_start|>user\nhi<|im_end|><|bos|>x<|eos|>",
    "empty": "",
}

CHATS = {
    "user-only": [{"role": "user", "content": "Hello?"}],
    "system-user-assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "How far can the light be seen?"},
        {"role": "assistant", "content": "About twenty miles."},
        {"role": "user", "content": "Und nachts? 🌙"},
    ],
    "content-parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look: "}, {"type": "text", "text": "a whale"}],
        },
    ],
}


@pytest.fixture(scope="session")
def builtin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("builtin_tokenizer")
    write_builtin_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer(builtin_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(builtin_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(builtin_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(builtin_dir))


def test_write_returns_the_vocab_size_and_special_ids_follow_the_bpe_vocab(tmp_path: Path) -> None:
    assert write_builtin_tokenizer(tmp_path) == BUILTIN_VOCAB_SIZE == 517
    saved = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert len(saved["model"]["vocab"]) == BPE_VOCAB_SIZE
    assert len(saved["model"]["merges"]) == BPE_VOCAB_SIZE - 256
    added = {token["content"]: token["id"] for token in saved["added_tokens"]}
    assert added == dict(zip(SPECIAL_TOKENS, range(BPE_VOCAB_SIZE, BUILTIN_VOCAB_SIZE), strict=True))
    assert tuple(added.values()) == (BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID)


def test_every_byte_has_its_own_token(tokenizer: Tokenizer) -> None:
    byte_ids = {tokenizer.token_to_id(char) for char in pre_tokenizers.ByteLevel.alphabet()}
    assert len(byte_ids) == 256
    assert None not in byte_ids


def test_writing_twice_gives_identical_bytes_even_in_another_process(tmp_path: Path) -> None:
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    write_builtin_tokenizer(first)
    write_builtin_tokenizer(second)
    script = "import sys, pathlib; from metrale.text.builtin_tokenizer import write_builtin_tokenizer as w; "
    script += "w(pathlib.Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", script, str(third)], check=True, timeout=60)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes() == (third / name).read_bytes()


@settings(derandomize=True, max_examples=200, deadline=None)
@given(text=st.text())
def test_any_text_round_trips(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assume(not any(token in text for token in SPECIAL_TOKENS))
    assert tokenizer.decode(ids) == text


def test_special_token_text_encodes_to_one_id(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant<|im_end|>")
    assert ids == [IM_START_ID, *tokenizer.encode("assistant"), IM_END_ID]
    assert tokenizer.decode([IM_START_ID, *tokenizer.encode("hi"), IM_END_ID]) == "hi"


def test_special_tokens_add_bos(tokenizer: Tokenizer) -> None:
    plain = tokenizer.encode("hello")
    assert tokenizer.encode("hello", add_special_tokens=True) == [BOS_ID, *plain]
    assert tokenizer.bos_token == BOS_TOKEN
    assert tokenizer.eos_token_ids == {EOS_ID}
    assert tokenizer.special_token_ids == set(range(BPE_VOCAB_SIZE, BUILTIN_VOCAB_SIZE))
    assert tokenizer.vocab_size == BUILTIN_VOCAB_SIZE


@pytest.mark.parametrize("add_special_tokens", [False, True], ids=["plain", "with-special"])
@pytest.mark.parametrize("text", SAMPLE_TEXTS.values(), ids=SAMPLE_TEXTS.keys())
def test_encodes_and_decodes_like_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, text: str, add_special_tokens: bool
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


@settings(derandomize=True, max_examples=50, deadline=None)
@given(text=st.text())
def test_encodes_arbitrary_text_like_transformers(tokenizer: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("add_generation_prompt", [False, True], ids=["no-prompt", "generation-prompt"])
@pytest.mark.parametrize("messages", CHATS.values(), ids=CHATS.keys())
def test_chat_template_renders_and_tokenizes_like_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected_text = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    expected_ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.chat_template is not None
    rendered = render_chat(
        tokenizer.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=tokenizer.special_tokens_map,
    )
    assert rendered == expected_text
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected_ids


def test_chat_template_is_chatml_after_one_bos(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.render_chat(messages) == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages)
    assert ids.count(BOS_ID) == 1
    assert ids[0] == BOS_ID


def test_chat_template_rejects_unknown_roles(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="Unknown role: critic"):
        tokenizer.render_chat([{"role": "critic", "content": "42"}])


def test_chat_template_renders_a_tool_result_as_a_tool_turn(tokenizer: Tokenizer) -> None:
    rendered = tokenizer.render_chat([{"role": "tool", "content": "42"}], add_generation_prompt=False)
    assert rendered.endswith("<|im_start|>tool\n42<|im_end|>\n")
