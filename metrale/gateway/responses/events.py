"""A response streamed with the Responses API's events (``event: <type>`` + ``data: {json}``)."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack
from typing import Any

from metrale.gateway.responses.output import OutputEvent
from metrale.gateway.responses.turn import Turn
from metrale.gateway.streams.choice import ChoiceDelta
from metrale.gateway.streams.generation import Generation
from metrale.gateway.streams.streaming import sse_event
from metrale.shared.errors import MetraleError


async def response_events(
    stack: AsyncExitStack, generation: Generation, first: ChoiceDelta | None, turn: Turn
) -> AsyncIterator[str]:
    """The Responses stream: ``response.created``, ``response.in_progress``, each output item's events
    as the text arrives (``output.py``), then ``response.completed`` (or ``.incomplete``)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\n{sse_event(json.dumps(data, ensure_ascii=False))}"

    def events(pieces: Iterable[OutputEvent]) -> str:
        return "".join(event(piece.kind, **piece.fields) for piece in pieces)

    async with stack:
        opening = turn.body("in_progress", [])
        yield event("response.created", response=opening) + event("response.in_progress", response=opening)
        try:
            delta = first
            while delta is not None:
                if delta.text and (text := events(turn.read(delta.text))):
                    yield text
                delta = await generation.next_delta()
            reply = generation.choices[0]
            closing = events(turn.end(reply))
            final = await turn.conclude(reply, generation.usage)
        except MetraleError as error:
            problem = error.to_openai()["error"]
            yield event("error", code=problem["code"], message=problem["message"], param=problem["param"])
            return
        yield closing + event(f"response.{final['status']}", response=final)
