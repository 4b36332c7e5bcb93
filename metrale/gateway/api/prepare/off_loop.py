"""Request work that grows with the request, moved off the event loop when it may take a while.

What is bounded and small runs inline (a thread hop costs more than it); a grammar to compile (a
``response_format`` schema, a forced tool call), tools to check and plan, and a large set of stop
strings to build an automaton from run in a worker thread, so the loop keeps serving streams and
probes meanwhile (contract 9).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from metrale.gateway.request_bodies import SamplingFields
from metrale.gateway.streams.stop_strings import stop_automaton

INLINE_STOP_CHARS = 1_000
"""Stop strings of up to this many characters in all get their automaton built on the loop (< 1 ms)."""

Result = TypeVar("Result")


async def run_off_loop(work: Callable[[], Result], *, inline: bool = False) -> Result:
    """``work()``, in a worker thread unless ``inline``."""
    return work() if inline else await asyncio.to_thread(work)


def compiles_grammar(body: SamplingFields, tool_grammar: str | None = None) -> bool:
    """Whether preparing ``body`` compiles a grammar (``structured_outputs.request_grammar``)."""
    constrains = body.response_format is not None and body.response_format.type != "text"
    return constrains or tool_grammar is not None


async def build_stop_automaton(stops: list[str]) -> None:
    """Build (and cache) the automaton of ``stops`` now, off the loop when they are long, so the
    choices that match them find it ready."""
    if stops:
        await run_off_loop(lambda: stop_automaton(tuple(stops)), inline=sum(map(len, stops)) <= INLINE_STOP_CHARS)
