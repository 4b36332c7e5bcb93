"""A choice decoded through the remembered single-token texts shows what the reference decoder shows."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.gateway.fleet.registry import build_tokenizer
from metrale.gateway.streams.choice import ChoiceDecoder, OneTokenTexts, one_token_texts_of
from metrale.shared.messages import FinishReason, TokenEvent
from metrale.text.builtin_tokenizer import BUILTIN_VOCAB_SIZE, STOP_TOKEN_IDS
from tests.gateway.harness import announcement

PROPERTY = settings(derandomize=True, deadline=None, max_examples=150)
TOKENIZER = build_tokenizer(announcement())  # the built-in byte-level BPE, as a gateway loads it

# Any id, special tokens included: byte-level pieces that split UTF-8 characters, and whole words.
token_ids = st.integers(0, BUILTIN_VOCAB_SIZE - 1)


def _texts(events: list[list[int]], prompt: list[int], *, skip_special_tokens: bool, remembered: bool) -> list[str]:
    decoder = ChoiceDecoder(
        0,
        TOKENIZER,
        prompt,
        stop_strings=(),
        stop_ids=STOP_TOKEN_IDS,
        skip_special_tokens=skip_special_tokens,
        one_token_texts=remembered,
    )
    texts = []
    for seq, ids in enumerate(events):
        last = seq == len(events) - 1
        event = TokenEvent("r", 0, seq, ids, "w", finished=last, finish_reason=FinishReason.LENGTH if last else None)
        texts.append(decoder.accept(event).text)
    return texts


@PROPERTY
@given(
    events=st.lists(st.lists(token_ids, min_size=1, max_size=3), min_size=1, max_size=12),
    prompt=st.lists(token_ids, max_size=6),
    skip_special_tokens=st.booleans(),
)
def test_deltas_are_the_reference_decoders(
    events: list[list[int]], prompt: list[int], skip_special_tokens: bool
) -> None:
    remembered = _texts(events, prompt, skip_special_tokens=skip_special_tokens, remembered=True)
    reference = _texts(events, prompt, skip_special_tokens=skip_special_tokens, remembered=False)
    assert remembered == reference


@PROPERTY
@given(ids=st.lists(token_ids, max_size=3), skip_special_tokens=st.booleans())
def test_one_token_texts_decode_as_the_tokenizer(ids: list[int], skip_special_tokens: bool) -> None:
    texts = one_token_texts_of(TOKENIZER)
    for _ in range(2):  # the second time from what was remembered
        assert texts.decode(ids, skip_special_tokens=skip_special_tokens) == TOKENIZER.decode(
            ids, skip_special_tokens=skip_special_tokens
        )


def test_one_tokenizer_has_one_memory_and_an_unreferable_one_still_decodes() -> None:
    assert one_token_texts_of(TOKENIZER) is one_token_texts_of(TOKENIZER)

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
            return ",".join(map(str, ids))

    texts = one_token_texts_of(Unhashable())
    assert isinstance(texts, OneTokenTexts)
    assert texts.decode([7]) == "7"
