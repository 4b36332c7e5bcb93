from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.gateway.streams.stop_strings import NaiveStopStringMatcher, StopStringMatcher

MATCHERS = [
    pytest.param(StopStringMatcher, id="automaton"),
    pytest.param(NaiveStopStringMatcher, id="naive"),
]

Matcher = type[StopStringMatcher] | type[NaiveStopStringMatcher]


def feed(matcher_type: Matcher, stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    """Push ``pieces`` one by one; return what each push released, whether a stop matched, the flush."""
    matcher = matcher_type(stops)
    released = [matcher.push(piece) for piece in pieces]
    return released, matcher.matched, matcher.flush()


@pytest.mark.parametrize("matcher_type", MATCHERS)
@pytest.mark.parametrize(
    ("stops", "pieces", "shown", "matched"),
    [
        pytest.param(["END"], ["abc", "def"], "abcdef", False, id="no-stop"),
        pytest.param(["END"], ["abcEND", "more"], "abc", True, id="stop-inside-one-piece"),
        pytest.param(["END"], ["abcE", "N", "Dxyz"], "abc", True, id="stop-split-over-pieces"),
        pytest.param(["END"], ["abcE", "Nx"], "abcENx", False, id="false-start-released"),
        pytest.param(["xyz", "b"], ["axyzb"], "a", True, id="earliest-of-several"),
        pytest.param(["abcd", "bc"], ["xabcd"], "x", True, id="longer-earlier-start-wins"),
        pytest.param(["abcd", "bc"], ["xab", "c"], "xa", True, id="shorter-completes-first-across-pieces"),
        pytest.param(["aab", "ab"], ["aaab"], "a", True, id="overlapping-prefixes"),
        pytest.param(["\n\n"], ["line\n", "\nnext"], "line", True, id="newlines"),
        pytest.param([], ["anything"], "anything", False, id="no-stops"),
    ],
)
def test_text_is_cut_before_the_first_stop(
    matcher_type: Matcher, stops: list[str], pieces: list[str], shown: str, matched: bool
) -> None:
    released, was_matched, rest = feed(matcher_type, stops, pieces)
    assert "".join(released) + (rest if not was_matched else "") == shown
    assert was_matched == matched


@pytest.mark.parametrize("matcher_type", MATCHERS)
def test_only_a_possible_stop_prefix_is_held_back(matcher_type: Matcher) -> None:
    matcher = matcher_type(["STOP"])
    assert matcher.push("go ST") == "go "
    assert matcher.push("x") == "STx"
    assert matcher.flush() == ""


@pytest.mark.parametrize("matcher_type", MATCHERS)
def test_held_tail_is_flushed_at_the_end(matcher_type: Matcher) -> None:
    matcher = matcher_type(["STOP"])
    assert matcher.push("and ST") == "and "
    assert matcher.flush() == "ST"


@pytest.mark.parametrize("matcher_type", MATCHERS)
def test_nothing_after_a_match(matcher_type: Matcher) -> None:
    matcher = matcher_type(["."])
    assert matcher.push("one. two") == "one"
    assert matcher.push("three") == ""


@pytest.mark.parametrize("matcher_type", MATCHERS)
def test_empty_stop_strings_are_refused(matcher_type: Matcher) -> None:
    with pytest.raises(ValueError, match="empty"):
        matcher_type([""])


_ALPHABET = "abc\n"  # few letters: stop strings overlap, share prefixes and occur often


@settings(max_examples=600, deadline=None)
@given(
    stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=5), max_size=6),
    pieces=st.lists(st.text(_ALPHABET, max_size=8), max_size=10),
    flush_at=st.integers(min_value=0, max_value=10),
)
def test_the_automaton_agrees_with_the_naive_twin(stops: list[str], pieces: list[str], flush_at: int) -> None:
    """Same releases push by push, same match, same held tail (also across a flush mid-text)."""
    automaton, naive = StopStringMatcher(stops), NaiveStopStringMatcher(stops)
    for index, piece in enumerate(pieces):
        if index == flush_at:
            assert automaton.flush() == naive.flush()
        assert automaton.push(piece) == naive.push(piece), (stops, pieces[: index + 1])
        assert automaton.matched == naive.matched
    assert automaton.flush() == naive.flush()


@settings(max_examples=600, deadline=None)
@given(
    stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=3), max_size=3),
    pieces=st.lists(st.text(_ALPHABET + "xyz", max_size=6), max_size=10),
)
def test_pieces_no_stop_string_starts_in_agree_with_the_naive_twin(stops: list[str], pieces: list[str]) -> None:
    """Pieces drawn mostly from letters no stop string holds (released without stepping the automaton
    while nothing is held back), between pieces that start or complete a stop string."""
    automaton, naive = StopStringMatcher(stops), NaiveStopStringMatcher(stops)
    for index, piece in enumerate(pieces):
        assert automaton.push(piece) == naive.push(piece), (stops, pieces[: index + 1])
        assert automaton.matched == naive.matched
    assert automaton.flush() == naive.flush()


def test_many_long_stop_strings_cost_time_linear_in_the_text() -> None:
    """64 stop strings of 512 characters sharing a long prefix (each held tail is a candidate for all
    of them): 20,000 characters in 5,000 pieces take well under a second (generous: ~0.1 s unloaded)."""
    stops = ["x" * 500 + f"{index:012d}" for index in range(64)]
    matcher = StopStringMatcher(stops)
    start = time.perf_counter()
    released = "".join(matcher.push("xxxx") for _ in range(5000)) + matcher.flush()
    assert time.perf_counter() - start < 1.0
    assert released == "x" * 20000
    assert not matcher.matched
