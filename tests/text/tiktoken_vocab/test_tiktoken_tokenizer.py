"""A Kimi tiktoken folder: ids as the release's tokenizer (tiktoken) and transformers give them, decoding,
streaming and the chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.text.detokenizer import IncrementalDetokenizer
from metrale.text.tiktoken_vocab.kimi_writer import KimiTokenizerIds, write_kimi_tokenizer
from metrale.text.tokenizer import Tokenizer
from tests.text.kimi_reference import (
    KIMI_PAT_STR,
    kimi_encoding,
    split_pattern,
    transformers_tokenizer,
)

FIXED_TEXTS = [
    "我们在北京学习中文。今天天气很好！",
    "中文abc混合English文字123",
    "日本語のテキストとカタカナ、한국어 텍스트",
    "👋 👋🏽 😀😀 👩‍💻 🇫🇷 ❤️✨",
    "0 1 12 123 1234 12345 3.14159 2026-12-01 $42.50 ²³ ٣٤٥",
    "It's what they'd said: we'll see, I'M sure, DON'T worry, you're right.",
    "   leading spaces,\t\ttabs,\n\n\nnewlines\r\n and trailing   ",
    'def fibonacci(n: int) -> list[int]:\n    values = [0, 1]\n    return values[:n]  # {"k": [1]}\n',
    "CamelCaseIdentifiers HelloWorld parseJSONValue HTTPServer ÉCOLEétait naïve e\u0301",
    "<|im_user|>user<|im_middle|>hi<|im_end|>[BOS] text [EOS]",
    "",
]

FRAGMENTS = [
    "中文", "北京大学", "。", "，", "カタカナ", "한국어", "👋", "🏽", "👩‍💻", "\u200d", "e\u0301", "ÉCOLE", "straße",
    "it's", "DON'T", "we'll", "'s", "'", "HelloWorld", "HTTP", "0", "12", "12345", "3.14", "²", "٣",
    " ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", " \n ", "def f(x):", "    return x", "{}", "[1, 2]", "!=",
    "<|im_end|>", "[BOS]", "<|im_middle|>",
]  # fmt: skip

TEXTS = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(st.characters(codec="utf-8"), max_size=6)), max_size=24
).map("".join)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("kimi_tokenizer")
    ids = write_kimi_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "kimi_linear", "eos_token_id": ids.eos_token_id}))
    return directory


@pytest.fixture(scope="module")
def ids(kimi_dir: Path) -> KimiTokenizerIds:
    base = sum(1 for line in (kimi_dir / "tiktoken.model").read_bytes().splitlines() if line)
    return KimiTokenizerIds(base, base + 256, base, base + 2, base + 255)


@pytest.fixture(scope="module")
def ours(kimi_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(kimi_dir)


@pytest.fixture(scope="module")
def reference(kimi_dir: Path) -> Any:
    return kimi_encoding(kimi_dir)


@pytest.fixture(scope="module")
def hf(kimi_dir: Path) -> Any:
    return transformers_tokenizer(kimi_dir, kimi_split=True)


@pytest.mark.parametrize("text", FIXED_TEXTS)
def test_ids_equal_the_release_tokenizer_and_transformers(ours: Tokenizer, reference: Any, hf: Any, text: str) -> None:
    expected = reference.encode(text, allowed_special="all")
    assert ours.encode(text) == expected
    assert hf.encode(text, add_special_tokens=False) == expected
    assert ours.encode(text, add_special_tokens=True) == expected  # no BOS: the release adds none


@given(text=TEXTS)
def test_ids_equal_on_generated_text(ours: Tokenizer, reference: Any, hf: Any, text: str) -> None:
    expected = reference.encode(text, allowed_special="all")
    assert ours.encode(text) == expected
    assert hf.encode(text, add_special_tokens=False) == expected
    assert ours.decode(expected, skip_special_tokens=False) == reference.decode(expected)


@given(text=TEXTS, picks=st.lists(st.integers(min_value=0), max_size=8))
def test_any_ids_decode_as_the_release_tokenizer_decodes(
    ours: Tokenizer, reference: Any, text: str, picks: list[int]
) -> None:
    """Ids cut anywhere (half a character, a lone special): the same text, U+FFFD included."""
    ids = reference.encode(text + " 北京👋🏽", allowed_special="all")
    chosen = [ids[pick % len(ids)] for pick in picks]
    assert ours.decode(chosen, skip_special_tokens=False) == reference.decode(chosen)


def test_the_vocabulary_has_specials_after_the_base_and_reserved_names(
    ours: Tokenizer, hf: Any, ids: KimiTokenizerIds
) -> None:
    assert ours.vocab_size == len(hf) == ids.vocab_size
    assert ours.token_to_id("[BOS]") == ids.bos_token_id == hf.bos_token_id
    assert ours.token_to_id("<|im_end|>") == ids.eos_token_id == hf.eos_token_id
    assert ours.token_to_id("[PAD]") == ids.pad_token_id == hf.pad_token_id
    assert ours.eos_token_ids == {ids.eos_token_id}
    assert ours.special_token_ids == set(range(ids.base_vocab_size, ids.vocab_size))
    unnamed = ids.base_vocab_size + 5
    assert hf.convert_ids_to_tokens([unnamed]) == [f"<|reserved_token_{unnamed}|>"]
    assert ours.token_to_id(f"<|reserved_token_{unnamed}|>") == unnamed
    assert ours.encode(f"a<|reserved_token_{unnamed}|>b") == [ours.token_to_id("a"), unnamed, ours.token_to_id("b")]


def test_transformers_alone_splits_with_cl100k_not_kimi(kimi_dir: Path) -> None:
    """Why the pattern's yardstick is tiktoken: without the remote code transformers does not know Kimi's."""
    plain = transformers_tokenizer(kimi_dir, kimi_split=False)
    assert split_pattern(plain).startswith("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+")
    assert split_pattern(plain) != KIMI_PAT_STR


def test_decode_drops_specials_unless_kept(ours: Tokenizer, reference: Any) -> None:
    ids = reference.encode("<|im_user|>user<|im_middle|>北京 👋🏽<|im_end|>", allowed_special="all")
    assert ours.decode(ids) == "user北京 👋🏽"
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)


@pytest.mark.parametrize("text", FIXED_TEXTS[:6])
def test_streamed_text_equals_the_decoded_text(ours: Tokenizer, reference: Any, text: str) -> None:
    prompt = reference.encode("前文 prompt ", allowed_special="all")
    generated = reference.encode(text, allowed_special="all")
    detokenizer = IncrementalDetokenizer(ours, prompt)
    deltas = [detokenizer.push([token]) for token in generated]
    streamed = "".join(deltas) + detokenizer.flush()
    assert streamed == ours.decode(generated)
    assert all("\ufffd" not in delta for delta in deltas)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _call(call_id: str, arguments: str | dict[str, str]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


CHATS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "system-multi-turn": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi 👋, 你好"},
            {"role": "assistant", "content": "Hello! 你好！"},
            {"role": "user", "content": [{"type": "text", "text": "What's 2+2?"}]},
        ],
        {},
    ),
    "no-system": ([{"role": "user", "content": "It's me."}], {}),
    "tools-calls-results": (
        [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Weather in Paris and 北京?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [_call("c1", '{"city": "Paris"}'), _call("c2", {"city": "北京"})],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "12°C"},
            {"role": "tool", "tool_call_id": "c2", "content": "20°C"},
            {"role": "assistant", "content": "Paris 12°C, 北京 20°C."},
            {"role": "user", "content": "And Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("c3", "{}")]},
            {"role": "tool", "tool_call_id": "c3", "content": "18°C"},
        ],
        {"tools": TOOLS},
    ),
}


@pytest.mark.parametrize("generation_prompt", [True, False], ids=["prompt", "no-prompt"])
@pytest.mark.parametrize("name", sorted(CHATS))
def test_chat_rendering_equals_transformers(
    ours: Tokenizer, hf: Any, reference: Any, name: str, generation_prompt: bool
) -> None:
    messages, extra = CHATS[name]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)
    assert ours.render_chat(messages, add_generation_prompt=generation_prompt, **extra) == expected
    ids = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, **extra)
    assert ids == reference.encode(expected, allowed_special="all")


def test_the_chat_format_is_kimis(ours: Tokenizer) -> None:
    messages, extra = CHATS["tools-calls-results"]
    text = ours.render_chat(messages, **extra)
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":')
    assert "<|im_system|>system<|im_middle|>Use the tools.<|im_end|><|im_user|>user<|im_middle|>Weather" in text
    assert (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1' in text
    )
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n20°C<|im_end|>" in text
    assert "## Return of functions.get_weather:2\n18°C<|im_end|><|im_assistant|>assistant<|im_middle|>" in text
    assert ours.render_chat(messages[1:2]).startswith("<|im_system|>system<|im_middle|>You are a helpful assistant")
