"""Where a session's turn marks checkpoints: its prompt's end and settled length, and the previous turn's
prompt and reply ends only where the new tokenization agrees with them."""

from __future__ import annotations

from metrale.gateway.api.prepare.prompts import session_marks, settled_length
from metrale.shared.sessions import Transcript

SPECIAL = {1, 2}


def test_the_settled_length_ends_at_the_last_special_token() -> None:
    assert settled_length([1, 5, 6, 2, 7, 8], SPECIAL) == 4
    assert settled_length([5, 6], SPECIAL) == 0
    assert settled_length([5, 2], SPECIAL) == 2


def test_a_reply_that_re_tokenized_as_generated_marks_its_end() -> None:
    previous = Transcript("", (1, 5, 2, 9, 30, 31, 2), prompt_length=4)
    assert session_marks([1, 5, 2, 9, 30, 31, 2, 40, 2], previous, SPECIAL) == [3, 4, 6]


def test_a_reply_that_re_tokenized_differently_marks_only_what_agrees() -> None:
    previous = Transcript("", (1, 5, 2, 9, 30, 31, 2), prompt_length=4)
    # The prompt's last token (a newline, say) merged with the reply's first text on re-tokenization.
    assert session_marks([1, 5, 2, 90, 31, 2, 40, 2], previous, SPECIAL) == [3]
    assert session_marks([1, 5, 2, 9, 32, 31, 2, 40, 2], previous, SPECIAL) == [3, 4]


def test_the_transcript_keeps_its_prompt_length() -> None:
    transcript = Transcript("text", (1, 2, 3), prompt_length=2)
    assert Transcript.from_fields(transcript.to_fields()) == transcript
    legacy = {"text": b"text", "token_ids": transcript.to_fields()["token_ids"]}
    assert Transcript.from_fields(legacy) == Transcript("text", (1, 2, 3), prompt_length=0)
