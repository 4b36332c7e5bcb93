"""One request of several prompts (``/v1/completions`` with a list): one fleet request per prompt,
answered as one response whose choice ``i * n + j`` is prompt ``i``'s choice ``j`` (OpenAI's and
vLLM's order).

Every prompt is submitted at once and holds its own tenant place; a stream reads the prompts' deltas
in prompt order (a later prompt's events wait in its own event stream meanwhile), so each choice's
chunks come in order and the stream ends once every prompt's choices have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AsyncExitStack

from starlette.responses import Response

from metrale.gateway.state import Gateway
from metrale.gateway.streams.choice import ChoiceDelta
from metrale.gateway.streams.delivery import ChoiceTotals, Renderer, stream_events
from metrale.gateway.streams.generation import Generation, start_generation
from metrale.gateway.streams.streaming import sse_response
from metrale.gateway.streams.submission import Submission
from metrale.shared.messages import Usage


class GenerationGroup:
    """The generations of one request's prompts, read as one ``DeltaSource``: ``n`` choices each."""

    def __init__(self, generations: Sequence[Generation], n: int) -> None:
        self._generations = list(generations)
        self._n = n
        self._current = 0

    @property
    def finished(self) -> bool:
        return all(generation.finished for generation in self._generations)

    @property
    def has_ready_event(self) -> bool:
        return self._current < len(self._generations) and self._generations[self._current].has_ready_event

    @property
    def usage(self) -> Usage:
        """Summed over the prompts (each counts its own prompt tokens)."""
        usages = [generation.usage for generation in self._generations]
        return Usage(
            prompt_tokens=sum(usage.prompt_tokens for usage in usages),
            completion_tokens=sum(usage.completion_tokens for usage in usages),
            cached_tokens=sum(usage.cached_tokens for usage in usages),
        )

    async def next_delta(self) -> ChoiceDelta | None:
        """The next delta, its ``index`` the request's choice; None once every prompt has finished."""
        while self._current < len(self._generations):
            delta = await self._generations[self._current].next_delta()
            if delta is not None:
                return dataclasses.replace(delta, index=self._current * self._n + delta.index)
            self._current += 1
        return None


async def deliver_group(
    gateway: Gateway,
    submissions: Sequence[Submission],
    renderer: Renderer,
    *,
    n: int,
    stream: bool,
    include_usage: bool,
) -> Response:
    """Submit every prompt's ``Submission`` and answer with their output as one response, streamed or
    whole; each holds its own tenant place (429 if one has none: those taken are given back)."""
    stack = AsyncExitStack()
    try:
        rate_limits: dict[str, str] = {}
        for submission in submissions:
            rate_limits = await stack.enter_async_context(gateway.admission.tenant_place(submission.request))
        generations = []
        for submission in submissions:
            opened = start_generation(
                submission, relay=gateway.relay, dispatcher=gateway.dispatcher, metrics=gateway.metrics
            )
            generations.append(await stack.enter_async_context(opened))
        group = GenerationGroup(generations, n)
        if not stream:
            async with stack:
                totals = ChoiceTotals(n * len(submissions))
                while (delta := await group.next_delta()) is not None:
                    totals.add(delta)
                whole = renderer.response(totals.merged(), group.usage)
            return Response(whole.model_dump_json(), media_type="application/json", headers=rate_limits)
        first = await group.next_delta()
    except BaseException:
        await stack.aclose()
        raise
    response = sse_response(stream_events(stack, group, first, renderer, include_usage), on_close=stack.aclose)
    response.headers.update(rate_limits)
    return response
