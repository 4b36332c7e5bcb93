"""Stop strings, matched on the detokenized text of one choice as it streams.

Text that could be the start of a stop string is held back until the next piece of text shows whether
it is; everything else is released at once. When a stop string matches, the text is cut just before
it and the stop string itself is never shown (OpenAI's behaviour); when several match in one piece,
the one that starts first wins.

``StopStringMatcher`` runs every stop string at once through one Aho–Corasick automaton, in time
linear in the text whatever the number of stop strings; the automaton is built once per list of stop
strings (the choices of a request share it). A piece of text that arrives while nothing is held back
and holds no character a stop string starts with (every piece, for a request without stop strings)
is released as it is, without stepping the automaton through it. ``NaiveStopStringMatcher`` scans
each stop string on its own: the reference twin the automaton is tested against.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


def _check_stops(stops: Sequence[str]) -> None:
    if any(not stop for stop in stops):
        raise ValueError("stop strings must not be empty")


@dataclass(frozen=True, slots=True)
class StopAutomaton:
    """The Aho–Corasick automaton of a set of stop strings. State 0 is the root; state ``s`` stands for
    the text ``depth[s]`` characters long spelled on the trie path to it. ``fail[s]`` is the state of
    its longest proper suffix that is in the trie; ``match[s]`` is the length of the longest stop string
    that is a suffix of it (0: none)."""

    goto: list[dict[str, int]]
    fail: list[int]
    depth: list[int]
    match: list[int]

    @property
    def first_characters(self) -> frozenset[str]:
        """The characters some stop string starts with (none without stop strings)."""
        return frozenset(self.goto[0])

    def step(self, state: int, char: str) -> int:
        """The state after ``char``: the longest suffix of the text so far that is in the trie."""
        goto, fail = self.goto, self.fail
        while state and char not in goto[state]:
            state = fail[state]
        return goto[state].get(char, 0)


@functools.lru_cache(maxsize=64)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of ``stops`` (cached: each choice of a request asks for the same one)."""
    goto: list[dict[str, int]] = [{}]
    depth, ends = [0], [0]
    for stop in stops:
        state = 0
        for char in stop:
            if char not in goto[state]:
                goto[state][char] = len(goto)
                goto.append({})
                depth.append(depth[state] + 1)
                ends.append(0)
            state = goto[state][char]
        ends[state] = len(stop)
    fail, match = [0] * len(goto), list(ends)
    queue = deque(goto[0].values())
    while queue:  # breadth first: a state's fail state is shallower, so it is done already
        state = queue.popleft()
        for char, child in goto[state].items():
            fallback = fail[state]
            while fallback and char not in goto[fallback]:
                fallback = fail[fallback]
            fail[child] = goto[fallback].get(char, 0)
            match[child] = ends[child] or match[fail[child]]
            queue.append(child)
    return StopAutomaton(goto, fail, depth, match)


class StopStringMatcher:
    """Finds the first occurrence of any of ``stops`` in a text that arrives in pieces.

    Invariant: the held-back tail is the longest suffix of the text so far that is a proper prefix of
    a stop string, which is exactly the automaton state's text (no stop string can begin earlier);
    the text released so far contains no stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        _check_stops(stops)
        self._automaton = stop_automaton(tuple(stops))
        self._first_characters = self._automaton.first_characters
        self._state = 0
        self._held = ""
        self.matched = False

    def push(self, text: str) -> str:
        """Add ``text``; return what can be shown now. After a match, returns "" forever."""
        if self.matched:
            return ""
        if self._state == 0 and self._first_characters.isdisjoint(text):
            return text  # nothing held (state 0 holds no text), and no stop string can start in it
        held = self._held + text
        cut = self._scan(held, len(self._held))
        if cut is not None:
            self.matched = True
            self._held, self._state = "", 0
            return held[:cut]
        keep = self._automaton.depth[self._state]
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep]

    def flush(self) -> str:
        """The held-back text, released because no more text will come."""
        released, self._held, self._state = self._held, "", 0
        return released

    def _scan(self, held: str, start: int) -> int | None:
        """Feed ``held[start:]``; return where the earliest-starting stop string in ``held`` begins, if any.

        After a first match the scan goes on only while a longer stop string that began before it is
        still possible (the state's text reaches back before the best start)."""
        automaton, state, best = self._automaton, self._state, None
        for position in range(start, len(held)):
            state = automaton.step(state, held[position])
            end = position + 1
            if automaton.match[state]:
                begin = end - automaton.match[state]
                best = begin if best is None else min(best, begin)
            if best is not None and end - automaton.depth[state] >= best:
                break
        self._state = state
        return best


class NaiveStopStringMatcher:
    """``StopStringMatcher`` by scanning the held text for each stop string on every push: time grows
    with the number of stop strings times their length. The reference the automaton is tested against."""

    def __init__(self, stops: Sequence[str]) -> None:
        _check_stops(stops)
        self._stops = tuple(stops)
        self._held = ""
        self.matched = False

    def push(self, text: str) -> str:
        """Add ``text``; return what can be shown now. After a match, returns "" forever."""
        if self.matched:
            return ""
        self._held += text
        cut = self._first_match()
        if cut is not None:
            self.matched = True
            released, self._held = self._held[:cut], ""
            return released
        keep = self._partial_match_length()
        released = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return released

    def flush(self) -> str:
        """The held-back text, released because no more text will come."""
        released, self._held = self._held, ""
        return released

    def _first_match(self) -> int | None:
        positions = [index for stop in self._stops if (index := self._held.find(stop)) >= 0]
        return min(positions, default=None)

    def _partial_match_length(self) -> int:
        """The length of the longest tail of the held text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:length]):
                    longest = length
                    break
        return longest
