"""The Python work of streaming one token event to a client, in-process: CPU µs per event.

    python bench/gateway_stream.py [--events 20000] [--repeats 3]

One request's ``Generation`` (built-in tokenizer, no stop strings, no logprobs) read by ``sse_writes``
with the ``/v1/completions`` renderer, one event offered per write — as each stream of a fleet at 64
streams gets one token per worker step. Covers the event stream, detokenizer, stop strings, per-token
metrics, chunk JSON and SSE encoding; not the relay's decoding, the task wake-up or the HTTP write
(``bench/fleet_cpu.py`` measures the whole gateway). CPU time of this process (``time.process_time``),
so it holds on a loaded machine; the median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from metrale.gateway.api.answer.completion_renderer import CompletionRenderer
from metrale.gateway.fleet.registry import ServedModel, build_tokenizer
from metrale.gateway.metrics import GatewayMetrics, RequestClock
from metrale.gateway.streams.delivery import sse_writes
from metrale.gateway.streams.event_stream import EventStream
from metrale.gateway.streams.generation import Generation
from metrale.gateway.streams.submission import Submission
from metrale.shared.messages import FinishReason, GenerateRequest, TokenEvent
from tests.gateway.harness import announcement

TEXT = "The lighthouse keeper woke before dawn and climbed the stairs to the lamp. "


async def per_event_us(model: ServedModel, token_ids: list[int], count: int) -> float:
    """CPU µs per event of one stream of ``count`` one-token events."""
    request_id = "cmpl-bench"
    request = GenerateRequest(request_id, model.name, "t", [1, 2], max_tokens=count, deadline=time.time() + 600)
    stream = EventStream(request_id)
    generation = Generation(Submission(request, model, ()), stream, RequestClock(GatewayMetrics(), time.monotonic()))
    renderer = CompletionRenderer(request_id=request_id, model=model.name, fingerprint="ab" * 32, n=1, logprobs=None)
    events = [
        TokenEvent(
            request_id,
            0,
            seq,
            [token_ids[seq % len(token_ids)]],
            "w",
            finished=seq == count - 1,
            finish_reason=FinishReason.LENGTH if seq == count - 1 else None,
        )
        for seq in range(count)
    ]
    stream.offer(events[:1])
    first = await generation.next_delta()
    started = time.process_time()
    offered = 1
    async for _ in sse_writes(generation, first, renderer, include_usage=True):
        if offered < count:
            stream.offer(events[offered : offered + 1])
            offered += 1
    return 1e6 * (time.process_time() - started) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = ServedModel(announcement(), build_tokenizer(announcement()))
    token_ids = model.tokenizer.encode(TEXT * 20)
    runs = [asyncio.run(per_event_us(model, token_ids, args.events)) for _ in range(args.repeats)]
    each = ", ".join(f"{run:.2f}" for run in runs)
    print(f"CPU µs per event, one stream: median {statistics.median(runs):.2f} of {each}")


if __name__ == "__main__":
    main()
