"""The characters-per-token bound is sound (no text encodes to fewer tokens than it promises), and the
GIL-releasing encode gives transformers' ids."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from metrale.text.prompt_bound import max_chars_per_token, min_tokens_for
from metrale.text.tokenizer import Tokenizer

BUILTIN = Path(__file__).parents[2] / "metrale" / "builtin_model"


@cache
def builtin() -> Tokenizer:
    return Tokenizer.from_dir(BUILTIN)


@cache
def reference() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(BUILTIN))


texts = st.text(st.characters(codec="utf-8"), max_size=300) | st.lists(
    st.sampled_from(["<|im_end|>", "hello", " the", "\n", "🙂", "ab" * 20]), max_size=40
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_no_text_encodes_to_fewer_tokens_than_the_bound(text: str) -> None:
    per_token = builtin().max_chars_per_token
    assert per_token is not None
    assert len(builtin().encode(text)) >= min_tokens_for(len(text), per_token)


def test_the_longest_token_meets_the_bound_exactly() -> None:
    per_token = builtin().max_chars_per_token
    assert per_token is not None
    vocab = BackendTokenizer.from_file(str(BUILTIN / "tokenizer.json")).get_vocab()
    longest = max(vocab, key=len)
    text = builtin().decode([vocab[longest]])
    assert len(builtin().encode(text)) == 1 and len(text) <= per_token


@settings(max_examples=100, deadline=None)
@given(text=texts, add_special_tokens=st.booleans())
def test_the_gil_releasing_encode_gives_transformers_ids(text: str, add_special_tokens: bool) -> None:
    expected = reference().encode(text, add_special_tokens=add_special_tokens)
    assert builtin().encode_releasing_gil(text, add_special_tokens=add_special_tokens) == expected


def test_a_plain_bpe_tokenizer_gets_its_longest_entry() -> None:
    backend = BackendTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "[UNK]": 3}, [("a", "b")], unk_token="[UNK]"))
    assert max_chars_per_token(backend) == len("[UNK]")
    assert backend.encode("abzzzz").ids == [2, 3, 3, 3, 3]  # one unknown token per character


def _with(normalizer: object = None, pre_tokenizer: object = None) -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    return backend


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(_with(normalizer=normalizers.NFKC()), id="normalizer"),
        pytest.param(
            BackendTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), id="word-level-unknown-words"
        ),
        pytest.param(_with(pre_tokenizer=pre_tokenizers.Whitespace()), id="whitespace-drops-spaces"),
        pytest.param(_with(pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed")), id="split-removes"),
    ],
)
def test_no_bound_where_characters_can_vanish(backend: BackendTokenizer) -> None:
    assert max_chars_per_token(backend) is None
