from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from metrale.text.builtin_tokenizer import BUILTIN_VOCAB_SIZE, IM_END_ID, IM_START_ID, write_builtin_tokenizer
from metrale.text.detokenizer import PROMPT_CONTEXT_TOKENS, REPLACEMENT_CHARACTER, IncrementalDetokenizer
from metrale.text.tokenizer import Tokenizer

# Pieces whose UTF-8 bytes the built-in byte-level BPE (trained on English) splits across tokens.
MULTI_BYTE_PIECES = ["é", "ñ", "Å", "ß", "中", "文", "灯塔", "🚢", "👍🏽", "👨‍👩‍👧", "🌙", "\u0301"]
ASCII_PIECES = ["the ", "light", " keeper", ",", ".", "\n", " ", "42", "a", "Wind"]

texts = st.one_of(
    st.lists(st.sampled_from(MULTI_BYTE_PIECES + ASCII_PIECES), max_size=40).map("".join),
    st.text(max_size=60),
)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("builtin_tokenizer")
    write_builtin_tokenizer(directory)
    return Tokenizer.from_dir(directory)


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """``ids`` cut into consecutive chunks whose sizes cycle through ``sizes``: pushes of varied length."""
    chunks, start = [], 0
    while start < len(ids):
        size = sizes[len(chunks) % len(sizes)]
        chunks.append(ids[start : start + size])
        start += size
    return chunks


def stream(detokenizer: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]) -> list[str]:
    """Every delta, in order: one per chunk, then the flush."""
    return [detokenizer.push(chunk) for chunk in chunks] + [detokenizer.flush()]


def assert_streams_like_decode(
    tokenizer: Tokenizer, ids: list[int], sizes: list[int], skip_special_tokens: bool = True
) -> None:
    """Push ``ids`` in chunks and check every delta against ``decode`` of the ids pushed so far."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    emitted, pushed = "", 0
    for chunk in split(ids, sizes):
        emitted += detokenizer.push(chunk)
        pushed += len(chunk)
        so_far = tokenizer.decode(ids[:pushed], skip_special_tokens=skip_special_tokens)
        # Every delta is the final text at that place: nothing is ever taken back or replaced, so a
        # U+FFFD in a delta is one the whole decoding has there too.
        assert full.startswith(emitted)
        # Nothing is held back once the ids pushed so far end on a whole character.
        if not so_far.endswith(REPLACEMENT_CHARACTER):
            assert emitted == so_far
    assert emitted + detokenizer.flush() == full


@settings(derandomize=True, max_examples=300, deadline=None)
@given(text=texts, sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_deltas_of_text_join_to_the_text(tokenizer: Tokenizer, text: str, sizes: list[int]) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert_streams_like_decode(tokenizer, ids, sizes)


@pytest.mark.parametrize("skip_special_tokens", [True, False], ids=["skip-special", "keep-special"])
@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, BUILTIN_VOCAB_SIZE - 1), max_size=40),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
)
def test_deltas_of_any_id_stream_join_to_its_decoding(
    tokenizer: Tokenizer, ids: list[int], sizes: list[int], skip_special_tokens: bool
) -> None:
    assert_streams_like_decode(tokenizer, ids, sizes, skip_special_tokens)


@pytest.mark.parametrize(
    ("prompt", "output"),
    [("The keeper said: ", "Wind easing 🌙."), ("灯塔", "看守人"), ("", "é")],
    ids=["ascii-prompt", "cjk-prompt", "no-prompt"],
)
def test_a_prompt_gives_context_but_no_text(tokenizer: Tokenizer, prompt: str, output: str) -> None:
    prompt_ids, output_ids = tokenizer.encode(prompt), tokenizer.encode(output)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    assert "".join(stream(detokenizer, [[token] for token in output_ids])) == output


def test_a_character_begun_in_the_prompt_is_emitted_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab中")
    cut = next(n for n in range(len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT_CHARACTER))
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:cut])
    assert "".join(stream(detokenizer, [ids[cut:]])) == "中"


def test_special_tokens_are_dropped_or_kept(tokenizer: Tokenizer) -> None:
    ids = [IM_START_ID, *tokenizer.encode("assistant\nhi"), IM_END_ID]
    skipped = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream(skipped, [[token] for token in ids])) == "assistant\nhi"
    assert "".join(stream(kept, [[token] for token in ids])) == "<|im_start|>assistant\nhi<|im_end|>"


def test_flush_releases_a_partial_character_as_the_replacement_character(tokenizer: Tokenizer) -> None:
    first_byte_of_emoji = tokenizer.encode("🚢")[:1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(first_byte_of_emoji) == ""
    assert detokenizer.flush() == tokenizer.decode(first_byte_of_emoji) == REPLACEMENT_CHARACTER


def test_a_leading_space_comes_from_the_prefix_token() -> None:
    # SentencePiece-style decoding drops the "▁" space of a text's first token, so a token decoded on its
    # own ("world") differs from the same token after another (" world").
    backend = BackendTokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2}, unk_token="!"))
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer = Tokenizer(backend, special_tokens={})
    assert tokenizer.decode([1]) == "world"
    assert "".join(stream(IncrementalDetokenizer(tokenizer), [[0], [1], [2]])) == "Hello world!"
    assert "".join(stream(IncrementalDetokenizer(tokenizer, prompt_ids=[0]), [[1], [2]])) == " world!"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each ``decode`` call was given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_push_decodes_a_window_not_the_whole_output(tokenizer: Tokenizer) -> None:
    text = "The light flashed every 7.5 seconds; 灯塔 🚢 naïve façade. " * 40
    ids = tokenizer.encode(text)
    cut = next(n for n in range(100, len(ids)) if not tokenizer.decode(ids[:n]).endswith(REPLACEMENT_CHARACTER))
    prompt_ids, output_ids = ids[:cut], ids[cut:]
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, prompt_ids=prompt_ids)
    output_text = "".join(stream(detokenizer, [[token] for token in output_ids]))
    assert tokenizer.decode(prompt_ids) + output_text == text
    assert len(output_ids) > 1000
    longest_character = max(len(tokenizer.encode(char)) for char in text)
    # The window holds the prompt context or the last emitted tokens, plus the unread ones.
    assert max(counting.decoded_lengths) <= PROMPT_CONTEXT_TOKENS + 2 * longest_character
