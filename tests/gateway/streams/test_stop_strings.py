from __future__ import annotations

import pytest

from metrale.gateway.streams.stop_strings import StopStringMatcher


def feed(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    """Push ``pieces`` one by one; return what each push released, whether a stop matched, the flush."""
    matcher = StopStringMatcher(stops)
    released = [matcher.push(piece) for piece in pieces]
    return released, matcher.matched, matcher.flush()


@pytest.mark.parametrize(
    ("stops", "pieces", "shown", "matched"),
    [
        pytest.param(["END"], ["abc", "def"], "abcdef", False, id="no-stop"),
        pytest.param(["END"], ["abcEND", "more"], "abc", True, id="stop-inside-one-piece"),
        pytest.param(["END"], ["abcE", "N", "Dxyz"], "abc", True, id="stop-split-over-pieces"),
        pytest.param(["END"], ["abcE", "Nx"], "abcENx", False, id="false-start-released"),
        pytest.param(["xyz", "b"], ["axyzb"], "a", True, id="earliest-of-several"),
        pytest.param(["\n\n"], ["line\n", "\nnext"], "line", True, id="newlines"),
        pytest.param([], ["anything"], "anything", False, id="no-stops"),
    ],
)
def test_text_is_cut_before_the_first_stop(stops: list[str], pieces: list[str], shown: str, matched: bool) -> None:
    released, was_matched, rest = feed(stops, pieces)
    assert "".join(released) + (rest if not was_matched else "") == shown
    assert was_matched == matched


def test_only_a_possible_stop_prefix_is_held_back() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("go ST") == "go "
    assert matcher.push("x") == "STx"
    assert matcher.flush() == ""


def test_held_tail_is_flushed_at_the_end() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("and ST") == "and "
    assert matcher.flush() == "ST"


def test_nothing_after_a_match() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.push("one. two") == "one"
    assert matcher.push("three") == ""


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher([""])
