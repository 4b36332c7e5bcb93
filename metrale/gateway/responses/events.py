"""A response streamed with the Responses API's events (``event: <type>`` + ``data: {json}``)."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

from metrale.gateway.responses.objects import output_message, text_part
from metrale.gateway.responses.turn import Turn
from metrale.gateway.streams.choice import ChoiceDelta
from metrale.gateway.streams.generation import Generation
from metrale.gateway.streams.streaming import sse_event
from metrale.shared.errors import MetraleError


async def response_events(
    stack: AsyncExitStack, generation: Generation, first: ChoiceDelta | None, turn: Turn
) -> AsyncIterator[str]:
    """The Responses stream: created, in_progress, the message item and its text part opening, a
    delta per text piece, then their ``done`` events and ``response.completed`` (or ``.incomplete``)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\n{sse_event(json.dumps(data, ensure_ascii=False))}"

    where = {"item_id": turn.message_id, "output_index": 0}
    async with stack:
        opening = turn.body("in_progress", [])
        yield (
            event("response.created", response=opening)
            + event("response.in_progress", response=opening)
            + event(
                "response.output_item.added", output_index=0, item=output_message(turn.message_id, "", "in_progress")
            )
            + event("response.content_part.added", **where, content_index=0, part=text_part(""))
        )
        try:
            delta = first
            while delta is not None:
                if delta.text:
                    yield event("response.output_text.delta", **where, content_index=0, delta=delta.text, logprobs=[])
                delta = await generation.next_delta()
            final = await turn.conclude(generation.choices[0], generation.usage)
        except MetraleError as error:
            problem = error.to_openai()["error"]
            yield event("error", code=problem["code"], message=problem["message"], param=problem["param"])
            return
        message = final["output"][0]
        text = message["content"][0]["text"]
        yield (
            event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            + event("response.content_part.done", **where, content_index=0, part=text_part(text))
            + event("response.output_item.done", output_index=0, item=message)
            + event(f"response.{final['status']}", response=final)
        )
