"""Running a submission and answering the client: one JSON body, or an SSE stream.

A stream's HTTP status is decided by its first delta: the gateway waits for the first token (or the
first failure) before sending headers, so a refusal, a failure on the fleet or a deadline before any
output is still a proper 400, 500 or 504. Errors after that travel in the stream as an error event,
followed by ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.responses import Response

from metrale.gateway.state import Gateway
from metrale.gateway.streams.choice import ChoiceDelta
from metrale.gateway.streams.generation import start_generation
from metrale.gateway.streams.streaming import SSE_DONE, sse_error, sse_event, sse_response
from metrale.gateway.streams.submission import Submission
from metrale.shared.errors import MetraleError
from metrale.shared.messages import Usage

MAX_EVENTS_PER_WRITE = 64
"""The most SSE events joined into one write to the client."""


class Renderer(Protocol):
    """Turns deltas into one endpoint's response objects (chat or text completions).

    Stream chunks come as their JSON text: one is written per token event, so a renderer may build
    it directly (``chunk_json.py``) rather than through a pydantic model.
    """

    def opening_chunks(self) -> Sequence[str]:
        """Chunks a stream starts with, before any delta."""
        ...

    def delta_chunk(self, delta: ChoiceDelta) -> str | None:
        """The chunk for one delta, or None when it carries nothing to show."""
        ...

    def usage_chunk(self, usage: Usage) -> str:
        """The last chunk of a stream that asked for usage."""
        ...

    def response(self, deltas: Sequence[ChoiceDelta], usage: Usage) -> BaseModel:
        """The whole (non-streamed) response."""
        ...


class DeltaSource(Protocol):
    """What a stream reads its deltas from: one ``Generation``, or several read as one."""

    @property
    def finished(self) -> bool: ...

    @property
    def has_ready_event(self) -> bool: ...

    @property
    def usage(self) -> Usage: ...

    async def next_delta(self) -> ChoiceDelta | None: ...


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request ready to submit, and the renderer of its answer."""

    submission: Submission
    renderer: Renderer


async def deliver(gateway: Gateway, prepared: Prepared, *, stream: bool, include_usage: bool) -> Response:
    """Submit ``prepared`` and answer with its output, streamed or whole; 429 when its tenant has no
    place for it (``fleet/admission.py``; the fleet admitted it before its prompt was prepared). The
    response carries the tenant's ``x-ratelimit-*`` headers."""
    submission, renderer = prepared.submission, prepared.renderer
    if not stream:
        async with gateway.admission.tenant_place(submission.request) as rate_limits:
            whole = await _whole_response(gateway, prepared)
            return Response(whole.model_dump_json(), media_type="application/json", headers=rate_limits)
    opened = start_generation(submission, relay=gateway.relay, dispatcher=gateway.dispatcher, metrics=gateway.metrics)
    stack = AsyncExitStack()
    try:
        rate_limits = await stack.enter_async_context(gateway.admission.tenant_place(submission.request))
        generation = await stack.enter_async_context(opened)
        first = await generation.next_delta()
    except BaseException:
        await stack.aclose()
        raise
    response = sse_response(stream_events(stack, generation, first, renderer, include_usage), on_close=stack.aclose)
    response.headers.update(rate_limits)
    return response


async def answer_whole(gateway: Gateway, prepared: Prepared, *, attach: bool = False) -> dict[str, Any]:
    """Run ``prepared`` to its end and return the whole response body, as JSON values.

    With ``attach``, a request that already has a record (submitted by a batch runner that died since)
    is followed rather than submitted again."""
    body: dict[str, Any] = (await _whole_response(gateway, prepared, attach=attach)).model_dump(mode="json")
    return body


async def _whole_response(gateway: Gateway, prepared: Prepared, *, attach: bool = False) -> BaseModel:
    """The whole response object. Deltas are folded into one per choice as they arrive, so what is
    held at the end is the answer once (its pieces joined), then its rendering; the caller
    serializes that straight to bytes."""
    opened = start_generation(
        prepared.submission, relay=gateway.relay, dispatcher=gateway.dispatcher, metrics=gateway.metrics, attach=attach
    )
    totals = ChoiceTotals(prepared.submission.request.n)
    async with opened as generation:
        async for delta in generation.deltas():
            totals.add(delta)
    return prepared.renderer.response(totals.merged(), generation.usage)


class ChoiceTotals:
    """Everything the deltas of ``n`` choices carried, per choice, gathered in place (``merge_deltas``
    on a whole list would hold every delta, and copy each choice's lists once per delta)."""

    def __init__(self, n: int) -> None:
        self._totals = [ChoiceDelta(index, "", [], None, None, None) for index in range(n)]
        self._texts: list[list[str]] = [[] for _ in range(n)]

    def add(self, delta: ChoiceDelta) -> None:
        """Fold ``delta`` into its choice."""
        total = self._totals[delta.index]
        self._texts[delta.index].append(delta.text)
        total.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            total.logprobs = total.logprobs if total.logprobs is not None else []
            total.logprobs.extend(delta.logprobs)
        if delta.top_logprobs is not None:
            total.top_logprobs = total.top_logprobs if total.top_logprobs is not None else []
            total.top_logprobs.extend(delta.top_logprobs)
        total.finish_reason = delta.finish_reason or total.finish_reason

    def merged(self) -> list[ChoiceDelta]:
        """One delta per choice, in order (what ``merge_deltas`` makes of all the deltas)."""
        for total, texts in zip(self._totals, self._texts, strict=True):
            total.text = "".join(texts)
        return self._totals


async def stream_events(
    stack: AsyncExitStack,
    generation: DeltaSource,
    first: ChoiceDelta | None,
    renderer: Renderer,
    include_usage: bool,
) -> AsyncIterator[str]:
    """``sse_writes`` inside ``stack``: closing it ends the request (and cancels it on the worker if
    it is still running, e.g. when the client went away)."""
    async with stack:
        async for write in sse_writes(generation, first, renderer, include_usage=include_usage):
            yield write


async def sse_writes(
    generation: DeltaSource, first: ChoiceDelta | None, renderer: Renderer, *, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE events of a stream whose first delta is ``first``, ending with ``[DONE]``.

    Events whose deltas are ready together go out as one write (up to ``MAX_EVENTS_PER_WRITE``); a
    delta is never held back waiting for one that has not arrived.
    """
    batch: list[str] = []
    try:
        batch += [sse_event(opening) for opening in renderer.opening_chunks()]
        delta = first
        while delta is not None:
            chunk = renderer.delta_chunk(delta)
            if chunk is not None:
                batch.append(sse_event(chunk))
            more_now = generation.has_ready_event or generation.finished
            if batch and (not more_now or len(batch) >= MAX_EVENTS_PER_WRITE):
                yield "".join(batch)
                batch = []
            delta = await generation.next_delta()
        if include_usage:
            batch.append(sse_event(renderer.usage_chunk(generation.usage)))
    except MetraleError as error:
        batch.append(sse_error(error))
    yield "".join(batch) + SSE_DONE
