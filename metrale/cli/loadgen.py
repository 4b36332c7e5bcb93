"""A load generator for any OpenAI-compatible completions endpoint, measured like ``vllm bench serve``.

Requests go to ``/v1/completions`` with the prompt as token ids (exact input lengths), streamed with
usage; arrivals either keep ``concurrency`` requests in flight or follow a Poisson process at
``request_rate`` per second.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from metrale.cli.sse_lines import aiter_sse_lines


@dataclass(frozen=True)
class LoadSpec:
    model: str
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    shared_prefix_len: int = 0
    concurrency: int = 32
    request_rate: float | None = None  # requests/s (Poisson); None = closed loop at ``concurrency``
    vocab: int = 500
    seed: int = 0


@dataclass
class RequestTiming:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(spec: LoadSpec) -> list[list[int]]:
    rng = random.Random(spec.seed)
    prefix = [rng.randrange(spec.vocab) for _ in range(spec.shared_prefix_len)]
    own = max(spec.input_len - spec.shared_prefix_len, 1)
    return [prefix + [rng.randrange(spec.vocab) for _ in range(own)] for _ in range(spec.num_prompts)]


async def _one(client: httpx.AsyncClient, spec: LoadSpec, prompt: list[int]) -> RequestTiming:
    body = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timing = RequestTiming(ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                timing.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return timing
            async for line in aiter_sse_lines(response.aiter_text()):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    timing.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if timing.ttft == 0.0:
                        timing.ttft = now - start
                    else:
                        timing.itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
        return timing
    timing.e2e = time.perf_counter() - start
    timing.ok = True
    return timing


async def run_load(base_url: str, spec: LoadSpec, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Send the whole load; return the report (see :func:`summarize`)."""
    prompts = make_prompts(spec)
    limits = httpx.Limits(max_connections=max(spec.concurrency, 1) + 8)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600.0, limits=limits) as client:
        gate = asyncio.Semaphore(spec.concurrency if spec.request_rate is None else len(prompts))
        rng = random.Random(spec.seed + 1)

        async def gated(prompt: list[int]) -> RequestTiming:
            async with gate:
                return await _one(client, spec, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if spec.request_rate:
                await asyncio.sleep(rng.expovariate(spec.request_rate))
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(spec, timings, duration)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "mean_ms": 1000 * statistics.fmean(ordered),
        "median_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * p99,
    }


def summarize(spec: LoadSpec, timings: list[RequestTiming], duration: float) -> dict[str, Any]:
    done = [t for t in timings if t.ok]
    output = sum(t.output_tokens for t in done)
    prompt = sum(t.prompt_tokens for t in done)
    tpot = [(t.e2e - t.ttft) / (t.output_tokens - 1) for t in done if t.output_tokens > 1]
    return {
        "completed": len(done),
        "failed": len(timings) - len(done),
        "errors": sorted({t.error for t in timings if not t.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
        "ttft": _stats([t.ttft for t in done]),
        "tpot": _stats(tpot),
        "itl": _stats([gap for t in done for gap in t.itl]),
        "e2e": _stats([t.e2e for t in done]),
        "spec": spec.__dict__,
    }
