"""Admission control under a cold burst (issues #18, #29): 200 concurrent streams of 64 tokens against
a FRESH ``met serve`` (no warm-up: the workers' start-up probe alone must make the bound hold) with
the built-in random-weight model and ``MET_MAX_QUEUE_WAIT_S=3``, the load generator on the same
machine; ``--runs`` times (3), each on a new deployment.

Per burst, no retries (``--client raw``, the default: requests written whole on connections opened
before it, ``raw_http.py``; or plain httpx): how many are refused, how fast the 429s come (from
writing the request to its response headers) and whether each has ``Retry-After``; the accepted
streams' time to first token (the gateway sends a stream's headers with its first token), and the
fleet's own queue wait of each request taken (arrival at the gateway to a worker taking it, sampled
from ``met:running:info``). ``holds``: the TTFT p99 is within the bound plus one full step (the
longest full step the heartbeats announced, before or after the burst). ``/health`` is asked
every 20 ms from a process of its own throughout (p50 / p99 / max).

The deployment runs on a private Redis like the one ``met serve`` starts itself (or ``--redis``),
so that the bench can read heartbeats and the running index. ``--split``: ``met worker`` + ``met
gateway`` as two processes instead of ``met serve``'s one, where the worker's engine thread and the
gateway share one interpreter lock. ``--warm-up``: one wave of ``--max-seqs`` streams first.
``--retried``: then the burst again through the official ``openai`` client retrying by itself.

    python -m bench.admission [--streams 200] [--max-seqs 64] [--max-tokens 64] [--wait 3] [--runs 3]
                              [--port 8766] [--redis URL] [--split] [--warm-up] [--retried] [--client raw|httpx]
    python -m bench.admission --floor [--streams 200]   # a trivial server's 429s, the same raw client
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from rich.console import Console
from rich.table import Table

from bench import raw_http

PROMPT = "The keeper of the light counted the waves until"
console = Console(width=200)


@dataclass(frozen=True)
class Attempt:
    """One streamed request without retries: its status, seconds from sending it to its response
    headers (for a stream, its first token: the gateway answers once it has one), the ``Retry-After``
    of a 429, and whether a 200 streamed to ``[DONE]``."""

    status: int
    headers_s: float
    retry_after: str | None
    completed: bool


@dataclass(frozen=True)
class Retried:
    """The burst through the openai client: how many completed and the seconds until the last did."""

    completed: int
    failed: int
    seconds: float


def percentile(values: list[float], share: float) -> float:
    """The ``share`` percentile of ``values`` (nearest rank)."""
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, round(share * len(ranked)) - 1))]


async def stream_once(client: httpx.AsyncClient, body: dict[str, object]) -> Attempt:
    """Send one streamed completion and read it to its end; timed from when its body was sent (so
    a client busy sending the rest of a burst does not count against the server) to its headers."""
    clock: dict[str, float] = {}

    async def trace(event: str, _: object) -> None:
        clock.setdefault(event, time.perf_counter())

    extensions = {"trace": trace}
    async with client.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, extensions=extensions
    ) as response:
        sent = clock.get("http11.send_request_body.complete", clock.get("http11.send_request_headers.complete", 0.0))
        headers_s = clock.get("http11.receive_response_headers.complete", time.perf_counter()) - sent
        if response.status_code != 200:
            await response.aread()
            return Attempt(response.status_code, headers_s, response.headers.get("retry-after"), False)
        done = False
        async for line in response.aiter_lines():
            done = done or line == "data: [DONE]"
        return Attempt(200, headers_s, None, done)


async def burst(
    base_url: str, api_key: str, model: str, streams: int, max_tokens: int, *, client: str = "raw"
) -> list[Attempt]:
    """``streams`` streamed completions sent together, none retried: through httpx, or (``raw``) each
    written whole on a connection opened before the burst (``raw_http.py``: the client's own event-loop
    work stays out of the timing)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if client == "raw":
        url = httpx.URL(base_url)
        sent = await raw_http.burst(
            str(url.host), int(url.port or 80), "/v1/completions", {**body, "stream": True}, headers, streams
        )
        return [Attempt(a.status, a.headers_s, a.retry_after, a.completed) for a in sent]
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300, limits=limits) as http:
        return await asyncio.gather(*(stream_once(http, body) for _ in range(streams)))


async def retried_burst(
    base_url: str, api_key: str, model: str, streams: int, max_tokens: int, *, retries: int = 100
) -> Retried:
    """``streams`` streamed completions through the official client, which retries 429s by itself, up to
    ``retries`` times each (the client's default is 2)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=retries, timeout=300)

    async def one() -> bool:
        stream = await client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        finished = [chunk.choices[0].finish_reason async for chunk in stream if chunk.choices]
        return "length" in finished

    began = time.perf_counter()
    outcomes = await asyncio.gather(*(one() for _ in range(streams)), return_exceptions=True)
    seconds = time.perf_counter() - began
    await client.close()
    completed = sum(outcome is True for outcome in outcomes)
    return Retried(completed, streams - completed, seconds)


def summary(attempts: list[Attempt]) -> dict[str, float]:
    """The figures the issue asks for, from one burst without retries."""
    refused = [a for a in attempts if a.status == 429]
    accepted = [a for a in attempts if a.status == 200]
    figures: dict[str, float] = {
        "accepted": len(accepted),
        "refused": len(refused),
        "other": len(attempts) - len(accepted) - len(refused),
    }
    if refused:
        figures |= {"429 without Retry-After": sum(a.retry_after is None for a in refused)}
        figures |= {"429 p50 ms": percentile([a.headers_s for a in refused], 0.5) * 1e3}
        figures |= {"429 p99 ms": percentile([a.headers_s for a in refused], 0.99) * 1e3}
    if accepted:
        figures |= {"TTFT p50 s": percentile([a.headers_s for a in accepted], 0.5)}
        figures |= {"TTFT p99 s": percentile([a.headers_s for a in accepted], 0.99)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--max-seqs", type=int, default=64, help="slots of the worker (met serve's default)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--wait", type=float, default=3.0, help="MET_MAX_QUEUE_WAIT_S")
    parser.add_argument("--runs", type=int, default=3, help="bursts, each on a fresh deployment")
    parser.add_argument("--warm-up", action="store_true", help="one wave of --max-seqs streams before each burst")
    parser.add_argument("--retried", action="store_true", help="then a burst through the retrying openai client")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--torch-threads", type=int, default=None, help="OMP_NUM_THREADS of the met processes")
    parser.add_argument("--redis", default=None, help="this Redis (default: a private one, as met serve starts)")
    parser.add_argument("--split", action="store_true", help="met worker + met gateway instead of met serve")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="only time the raw burst against a trivial ASGI app answering 429 at once (uvicorn, same port)",
    )
    parser.add_argument(
        "--client", choices=["raw", "httpx"], default="raw", help="the burst's client (raw: bench/raw_http.py)"
    )
    parser.add_argument(
        "--client-retries", type=int, default=100, help="max_retries of the openai client in the retried burst"
    )
    parser.add_argument("--met", default=shutil.which("met") or str(Path(sys.executable).with_name("met")))
    args = parser.parse_args()
    if args.floor:
        floor(args)
        return
    where = "met worker + met gateway" if args.split else "met serve"
    warm = "after a warm-up wave" if args.warm_up else "fresh"
    title = (
        f"{where} ({warm}, {args.client} client, load generator on this machine): {args.streams} streams x "
        f"{args.max_tokens} tokens, {args.max_seqs} slots, wait bound {args.wait:g} s"
    )
    rows = [one_run(args) for _ in range(args.runs)]
    table = Table(title=title)
    names = list(dict.fromkeys(name for row in rows for name in row))
    for name in names:
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(*(_cell(row.get(name)) for name in names))
    console.print(table)


def one_run(args: argparse.Namespace) -> dict[str, float | str]:
    """One burst on a fresh deployment: the issue's figures, ``/health`` during it, and whether the
    admitted requests' TTFT p99 kept within the bound plus one full step."""
    from metrale.worker.model.builtin import RANDOM_MODEL_NAME

    run = (f"http://127.0.0.1:{args.port}", "sk-bench", RANDOM_MODEL_NAME)
    with deployment(args) as (url, namespace):
        if args.warm_up:
            asyncio.run(burst(*run, args.max_seqs, args.max_tokens))
            await_slot_times(url, namespace, args.max_seqs)
        step_s = full_step_s(url, namespace)
        with QueueWaits(url, namespace) as sampler, HealthProbe(run[0]) as health:
            attempts = asyncio.run(burst(*run, args.streams, args.max_tokens, client=args.client))
        figures: dict[str, float | str] = dict(summary(attempts))
        figures |= health.figures()
        if sampler.waits:
            figures |= {"queue wait p99 s": percentile(list(sampler.waits.values()), 0.99)}
        step_after_s = full_step_s(url, namespace)
        bound = args.wait + max(step_s, step_after_s)
        ttft = figures.get("TTFT p99 s", 0.0)
        figures |= {"full step before s": step_s, "full step after s": step_after_s, "bound s": bound}
        figures |= {"holds": "yes" if isinstance(ttft, float) and ttft <= bound else "NO"}
        if args.retried:
            time.sleep(5)
            retried = asyncio.run(retried_burst(*run, args.streams, args.max_tokens, retries=args.client_retries))
            figures |= {"retried all done s": retried.seconds, "retried failed": retried.failed}
    console.print(figures)
    return figures


def _cell(value: float | str | None) -> str:
    if value is None:
        return ""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


class HealthProbe:
    """Asks ``/health`` every ``every_s`` from a process of its own (one kept-alive connection) while
    the block runs: its latency while the gateway works on a burst, with none of this process's own
    work on the burst (its event loop reading the streams) in the timing."""

    def __init__(self, base: str, every_s: float = 0.02) -> None:
        self.seconds: list[float] = []
        self.failed = 0
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=_probe_health, args=(base, every_s, self._stop, sender), daemon=True)

    def __enter__(self) -> HealthProbe:
        self._process.start()
        self._results.recv()  # asking from now on
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self.seconds, self.failed = self._results.recv()
        self._process.join()

    def figures(self) -> dict[str, float]:
        """``/health`` p50, p99 and max in ms, and how many asks failed."""
        if not self.seconds:
            return {}
        ms = [second * 1e3 for second in self.seconds]
        figures = {"health p50 ms": percentile(ms, 0.5), "health p99 ms": percentile(ms, 0.99)}
        return figures | {"health max ms": max(ms), "health failed": float(self.failed)}


def _probe_health(base: str, every_s: float, stop: Any, results: Any) -> None:
    """``HealthProbe``'s process: ask until ``stop`` is set, then send (seconds, failures) back."""
    seconds: list[float] = []
    failed = 0
    with httpx.Client(base_url=base, timeout=10) as client:
        client.get("/health")
        results.send("asking")
        while not stop.is_set():
            began = time.perf_counter()
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            seconds.append(time.perf_counter() - began)
            failed += not ok
            stop.wait(every_s)
    results.send((seconds, failed))


def floor(args: argparse.Namespace) -> None:
    """The raw burst against ``raw_http.refusing_app`` under uvicorn: how soon any Python server on
    this machine can answer a burst's requests, whatever it decides."""
    command = [sys.executable, "-m", "uvicorn", "bench.raw_http:refusing_app", "--port", str(args.port)]
    server = subprocess.Popen([*command, "--log-level", "warning"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{args.port}/", timeout=1)
                break
            time.sleep(0.1)
        body: dict[str, object] = {"prompt": PROMPT}
        sent = asyncio.run(raw_http.burst("127.0.0.1", args.port, "/v1/completions", body, {}, args.streams))
    finally:
        server.terminate()
        server.wait(timeout=30)
    seconds = [attempt.headers_s for attempt in sent if attempt.status == 429]
    console.print(
        f"floor, {len(seconds)} of {args.streams} answered 429: "
        f"p50 {percentile(seconds, 0.5) * 1e3:.0f} ms, p99 {percentile(seconds, 0.99) * 1e3:.0f} ms"
    )


@contextlib.contextmanager
def deployment(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """``met serve`` (or, with ``--split``, ``met worker`` + ``met gateway``) on ``args.redis`` or on a
    private Redis like the one ``met serve`` would start, ready: (its URL, the namespace); stopped after."""
    from metrale.cli.embedded_redis import start_embedded_redis
    from metrale.worker.model.builtin import random_model_dir

    with contextlib.ExitStack() as stack:
        url = args.redis
        if url is None:
            embedded = start_embedded_redis()
            stack.callback(embedded.close)
            url = embedded.url
        cache = Path(os.environ.get("MET_CACHE_DIR", "~/.cache/metrale")).expanduser()
        namespace = f"met-bench-{uuid.uuid4().hex[:8]}"
        env = {name: value for name, value in os.environ.items() if not name.startswith("MET_")}
        if args.torch_threads is not None:
            env |= {"OMP_NUM_THREADS": str(args.torch_threads)}
        env |= {"MET_MAX_QUEUE_WAIT_S": str(args.wait), "MET_HEARTBEAT_TTL_S": "3", "MET_API_KEYS": "sk-bench"}
        env |= {"MET_MODEL_DIR": str(random_model_dir(cache)), "MET_CACHE_DIR": str(cache)}
        env |= {"MET_NAMESPACE": namespace}
        seqs, port, redis = ["--max-seqs", str(args.max_seqs)], ["--port", str(args.port)], ["--redis", url]
        if args.split:
            commands = [[args.met, "worker", *redis, *seqs], [args.met, "gateway", *redis, *port]]
        else:
            commands = [[args.met, "serve", *port, *seqs, *redis, "--no-batch-runner"]]
        processes = [
            subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands
        ]
        try:
            _wait_ready(f"http://127.0.0.1:{args.port}", processes)
            yield url, namespace
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=30)
            _delete_namespace(url, namespace)


def full_step_s(url: str, namespace: str) -> float:
    """The longest full step the fleet's heartbeats announce: the loop's at full batch, else the
    start-up probe's (``WorkerHeartbeat.full_step_s``, ``probe_step_s``)."""
    import redis

    from metrale.shared.heartbeats import HEARTBEAT_FIELD, parse_heartbeat
    from metrale.shared.keys import Keys

    client = redis.Redis.from_url(url)
    steps = [0.0]
    for key in client.scan_iter(match=Keys(namespace).worker_pattern()):
        beat = parse_heartbeat(client.hget(key, HEARTBEAT_FIELD))  # type: ignore[arg-type]
        steps += [beat.full_step_s or beat.probe_step_s] if beat is not None else []
    client.close()
    return max(steps)


def slot_counters(url: str | None, namespace: str) -> tuple[int, int] | None:
    """The fleet's ``requests_finished`` and ``request_slot_ms`` heartbeat counters, summed (None
    without ``--redis``: ``met serve``'s embedded Redis is not reachable from here)."""
    if url is None:
        return None
    import redis

    from metrale.shared.heartbeats import HEARTBEAT_FIELD, parse_heartbeat
    from metrale.shared.keys import Keys

    client = redis.Redis.from_url(url)
    finished, slot_ms = 0, 0
    for key in client.scan_iter(match=Keys(namespace).worker_pattern()):
        beat = parse_heartbeat(client.hget(key, HEARTBEAT_FIELD))  # type: ignore[arg-type]
        counters = dict(beat.counters) if beat is not None else {}
        finished += counters.get("requests_finished", 0)
        slot_ms += counters.get("request_slot_ms", 0)
    client.close()
    return finished, slot_ms


def await_slot_times(url: str | None, namespace: str, finished: int, *, timeout_s: float = 30.0) -> None:
    """Wait until the workers' heartbeats count ``finished`` requests, then for gateways' heartbeat
    cache to take them in (without ``--redis``, just a few heartbeats' time)."""
    deadline = time.monotonic() + timeout_s
    while url is not None and time.monotonic() < deadline:
        counters = slot_counters(url, namespace)
        if counters is not None and counters[0] >= finished:
            break
        time.sleep(0.1)
    time.sleep(2.0 if url is None else 1.2)


class QueueWaits:
    """Samples the fleet's running index (``met:running:info``) every 50 ms from a thread: for each
    request a worker took, the seconds from its arrival at the gateway to being taken."""

    def __init__(self, url: str, namespace: str) -> None:
        import redis

        from metrale.shared.keys import Keys

        self.waits: dict[str, float] = {}
        self._client = redis.Redis.from_url(url)
        self._key = Keys(namespace).running_info()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> QueueWaits:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._client.close()

    def _sample(self) -> None:
        from metrale.shared.record import RunningEntry

        while not self._stop.is_set():
            running: dict[bytes, bytes] = self._client.hgetall(self._key)  # type: ignore[assignment]
            for request_id, raw in running.items():
                entry = RunningEntry.parse(request_id.decode(), raw)
                if entry is not None:
                    self.waits[entry.request_id] = entry.taken_at - entry.created_at
            time.sleep(0.05)


def _delete_namespace(url: str, namespace: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    stale = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    if stale:
        client.delete(*stale)
    client.close()


def _wait_ready(base: str, processes: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise SystemExit(f"a met process exited with {process.returncode}")
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the gateway did not become ready")


if __name__ == "__main__":
    main()
