"""How a stream's SSE events are grouped into writes: what is ready together goes out together."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import pytest

from metrale.gateway.api.completions import CompletionRenderer
from metrale.gateway.fleet.registry import ServedModel, build_tokenizer
from metrale.gateway.metrics import GatewayMetrics, RequestClock
from metrale.gateway.streams.choice import ChoiceDelta, merge_deltas
from metrale.gateway.streams.delivery import MAX_EVENTS_PER_WRITE, ChoiceTotals, sse_writes
from metrale.gateway.streams.event_stream import EventStream
from metrale.gateway.streams.generation import Generation
from metrale.gateway.streams.submission import Submission
from metrale.shared.messages import FinishReason, GenerateRequest, TokenEvent
from tests.gateway.harness import announcement, encode, sse_payloads

pytestmark = pytest.mark.anyio

REQUEST_ID = "cmpl-writes"
WORDS = ["The", " light", "house", " keeper", " woke"]


def _events(count: int) -> list[TokenEvent]:
    """``count`` events of choice 0, one word each (``_text(count)``), the last one final."""
    last = count - 1
    return [
        TokenEvent(
            request_id=REQUEST_ID,
            index=0,
            seq=seq,
            token_ids=encode(WORDS[seq % len(WORDS)]),
            worker_id="w",
            finished=seq == last,
            finish_reason=FinishReason.LENGTH if seq == last else None,
        )
        for seq in range(count)
    ]


def _text(count: int) -> str:
    return "".join(WORDS[seq % len(WORDS)] for seq in range(count))


def _generation(stream: EventStream) -> Generation:
    model = ServedModel(announcement(), build_tokenizer(announcement()))
    request = GenerateRequest(REQUEST_ID, model.name, "t", [1, 2], max_tokens=1024, deadline=time.time() + 30)
    return Generation(Submission(request, model, ()), stream, RequestClock(GatewayMetrics(), time.monotonic()))


def _renderer() -> CompletionRenderer:
    return CompletionRenderer(request_id=REQUEST_ID, model="m", fingerprint="ab" * 32, n=1, logprobs=None)


async def _writes(stream: EventStream, events: Sequence[TokenEvent], *, arriving_one_by_one: bool) -> list[str]:
    """Every write of the stream, ``events`` offered all at once or each after the previous write."""
    generation = _generation(stream)
    pending = list(events)
    stream.offer(pending if not arriving_one_by_one else [pending.pop(0)])
    if not arriving_one_by_one:
        pending = []
    first = await generation.next_delta()
    writes = []
    async for write in sse_writes(generation, first, _renderer(), include_usage=True):
        writes.append(write)
        if pending:
            stream.offer([pending.pop(0)])
    return writes


@pytest.mark.parametrize(
    ("count", "expected_writes"),
    [
        pytest.param(5, 1, id="few-in-one-write"),
        pytest.param(MAX_EVENTS_PER_WRITE + 3, 2, id="capped-per-write"),
    ],
)
async def test_events_ready_together_go_out_in_one_write(count: int, expected_writes: int) -> None:
    events = _events(count)
    writes = await _writes(EventStream(REQUEST_ID), events, arriving_one_by_one=False)
    assert len(writes) == expected_writes
    *chunks, usage = sse_payloads("".join(writes))
    assert len(chunks) == count
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == _text(count)
    assert usage["usage"]["completion_tokens"] == sum(len(event.token_ids) for event in events)


async def test_an_event_that_has_not_arrived_does_not_hold_back_the_ones_before_it() -> None:
    events = _events(4)
    writes = await _writes(EventStream(REQUEST_ID), events, arriving_one_by_one=True)
    # one write per event as it arrives; the final event's write also carries the usage and [DONE]
    assert len(writes) == 4
    assert [len(sse_payloads(write + "data: [DONE]\n\n")) for write in writes[:-1]] == [1, 1, 1]
    assert writes[-1].endswith("data: [DONE]\n\n")


async def test_the_next_event_is_ready_only_once_it_has_arrived() -> None:
    stream = EventStream(REQUEST_ID)
    events = _events(3)
    generation = _generation(stream)
    assert not generation.has_ready_event
    stream.offer([events[1]])  # held back: seq 0 is missing
    assert not generation.has_ready_event
    stream.offer([events[0]])
    assert generation.has_ready_event
    await generation.next_delta()
    assert generation.has_ready_event  # seq 1 was released with seq 0
    await generation.next_delta()
    assert not generation.has_ready_event
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await generation.next_delta()


async def test_a_token_that_decodes_to_a_line_separator_stays_inside_its_event() -> None:
    text = "one\u2028two\x85three\u2029"
    event = TokenEvent(REQUEST_ID, 0, 0, encode(text), "w", finished=True, finish_reason=FinishReason.LENGTH)
    body = "".join(await _writes(EventStream(REQUEST_ID), [event], arriving_one_by_one=False))
    lines = [line for line in body.splitlines() if line]  # as httpx's iter_lines reads them
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == text


def _delta(index: int, seq: int, *, logprobs: bool, last: bool) -> ChoiceDelta:
    return ChoiceDelta(
        index=index,
        text=f"<{index}:{seq}>",
        token_ids=[seq, seq + 1],
        logprobs=[-0.5 * seq, -0.25] if logprobs else None,
        top_logprobs=[[(seq, -0.5)], [(1, -0.1)]] if logprobs else None,
        finish_reason=FinishReason.STOP if last else None,
    )


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
def test_choice_totals_fold_deltas_as_merge_deltas_does(logprobs: bool) -> None:
    """Interleaved deltas of three choices, folded as they come, give what merging the whole list gives."""
    deltas = [_delta(index, seq, logprobs=logprobs, last=seq == 9) for seq in range(10) for index in (2, 0, 1)]
    totals = ChoiceTotals(3)
    for delta in deltas:
        totals.add(delta)
    assert totals.merged() == merge_deltas(deltas, 3)
