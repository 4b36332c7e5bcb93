"""The reasoning split: ``<think>…</think>`` is reasoning, the rest content, whether the prompt opened
the block or the model writes it; any split of a text into pieces gives what the whole text gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.text.chat_templates.qwen import QWEN3_5_CHAT_TEMPLATE
from metrale.text.reasoning import ReasoningDelta, ReasoningParser, prompt_opens_thinking, template_thinks


def whole(text: str, *, starts_inside: bool) -> tuple[str, str]:
    return joined(ReasoningParser(starts_inside=starts_inside), [text])


def joined(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    deltas: list[ReasoningDelta] = [parser.push(piece) for piece in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize(
    ("text", "starts_inside", "reasoning", "content"),
    [
        ("\nLet me think.\n</think>\n\nParis.", True, "Let me think.", "Paris."),
        ("<think>\nHm, two\nlines.\n</think>\n\nParis.", False, "Hm, two\nlines.", "Paris."),
        ("  \n<think>x</think>y", False, "x", "y"),
        ("Paris.", False, "", "Paris."),
        ("Paris. <think>not reasoning</think>", False, "", "Paris. <think>not reasoning</think>"),
        ("thinking, cut off mid-thou", True, "thinking, cut off mid-thou", ""),
        ("thinking </thi", True, "thinking </thi", ""),
        ("\n\n</think>\n\nAnswer", True, "", "Answer"),
        ("<thi", False, "", "<thi"),
        ("", True, "", ""),
        ("a</think>b</think>c", True, "a", "b</think>c"),
    ],
)
def test_a_text_splits_into_reasoning_and_content(text: str, starts_inside: bool, reasoning: str, content: str) -> None:
    assert whole(text, starts_inside=starts_inside) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_of_a_text_gives_what_the_whole_text_gives(data: st.DataObject) -> None:
    text = data.draw(
        st.sampled_from(
            [
                "\nLet me  think.\n\nMore. \n</think>\n\n Paris.\n",
                " <think>\n a \n b \n</think>c <think>",
                "plain answer \n",
                "<think>never closed \n\n",
                "\n\n</think>\n\n",
            ]
        )
    )
    starts_inside = data.draw(st.booleans())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    streamed = joined(ReasoningParser(starts_inside=starts_inside), pieces)
    assert streamed == whole(text, starts_inside=starts_inside)


def test_a_prompt_opens_thinking_when_its_last_think_block_is_open() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_a_template_that_writes_think_blocks_thinks() -> None:
    assert template_thinks(QWEN3_5_CHAT_TEMPLATE)
    assert not template_thinks("{{ messages }}")
    assert not template_thinks(None)
