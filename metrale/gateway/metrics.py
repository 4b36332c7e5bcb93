"""The gateway's Prometheus metrics, served at ``GET /metrics``.

Names follow vLLM's metrics with the prefix ``metrale_`` instead of ``vllm:``: Prometheus reserves
``:`` in metric names for recording rules, so an exporter's own names stay within ``[a-zA-Z0-9_]``.

| metric | kind | labels | what |
| --- | --- | --- | --- |
| ``metrale_requests_total`` | counter | ``endpoint``, ``status`` | requests by HTTP status (499: client left) |
| ``metrale_request_success_total`` | counter | ``finished_reason`` | choices finished, by finish reason |
| ``metrale_prompt_tokens_total`` | counter | | prompt tokens of requests that finished |
| ``metrale_generation_tokens_total`` | counter | | tokens generated |
| ``metrale_time_to_first_token_seconds`` | histogram | | submit to first token |
| ``metrale_inter_token_latency_seconds`` | histogram | | between successive token events of a request |
| ``metrale_e2e_request_latency_seconds`` | histogram | | submit to last token |
| ``metrale_queue_length`` | gauge | ``priority`` | entries in a request stream (XLEN) |
| ``metrale_queue_pending`` | gauge | ``priority`` | entries taken by a worker, not yet finished (XPENDING) |
| ``metrale_live_workers`` | gauge | | workers with an unexpired heartbeat |
| ``metrale_checkpoint_*`` | counter | | fleet-wide checkpoint counters (``fleet_counters.py``) |
| ``metrale_resumed_requests`` ... | counter | | fleet-wide failover counters (``fleet_counters.py``) |
| ``metrale_spec_decode_num_drafts`` | counter | | verify steps that carried draft tokens (speculative decoding) |
| ``metrale_spec_decode_num_draft_tokens`` | counter | | draft tokens verified |
| ``metrale_spec_decode_num_accepted_tokens`` | counter | | draft tokens accepted |
| ``metrale_spec_decode_num_accepted_tokens_per_pos`` | counter | ``position`` | accepted, by draft position |

Each ``GatewayMetrics`` owns its registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrale.gateway.fleet.counters import checkpoint_counters, failover_counters, speculation_counters
from metrale.gateway.fleet.dispatcher import QueueDepth
from metrale.gateway.token_metrics import UnlockedCounter, UnlockedHistogram
from metrale.shared.messages import FinishReason, Priority

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class GatewayMetrics:
    """Counters, histograms and gauges of one gateway."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "metrale_requests", "Generation requests by HTTP status.", ["endpoint", "status"], registry=registry
        )
        self.finished = Counter(
            "metrale_request_success", "Choices finished, by reason.", ["finished_reason"], registry=self.registry
        )
        self.prompt_tokens = Counter("metrale_prompt_tokens", "Prompt tokens processed.", registry=self.registry)
        # Per token: counted without prometheus_client's locks (token_metrics.py).
        self.generation_tokens = UnlockedCounter("metrale_generation_tokens", "Tokens generated.")
        registry.register(self.generation_tokens)
        self.time_to_first_token = Histogram(
            "metrale_time_to_first_token_seconds",
            "Time from submit to the first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = UnlockedHistogram(
            "metrale_inter_token_latency_seconds",
            "Time between successive token events of a request.",
            _TOKEN_GAP_BUCKETS,
        )
        registry.register(self.inter_token_latency)
        self.e2e_latency = Histogram(
            "metrale_e2e_request_latency_seconds",
            "Time from submit to the last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_length = Gauge("metrale_queue_length", "Request stream entries.", ["priority"], registry=registry)
        self.queue_pending = Gauge(
            "metrale_queue_pending", "Request stream entries taken by a worker.", ["priority"], registry=self.registry
        )
        self.live_workers = Gauge("metrale_live_workers", "Workers with a live heartbeat.", registry=self.registry)
        self.checkpoints = checkpoint_counters()
        self.registry.register(self.checkpoints)
        self.failover = failover_counters()
        self.registry.register(self.failover)
        self.speculation = speculation_counters()
        self.registry.register(self.speculation)

    def record_fleet(self, depths: Mapping[Priority, QueueDepth], live_workers: int) -> None:
        """Set the gauges read from Redis (at scrape time)."""
        for priority, depth in depths.items():
            self.queue_length.labels(priority=priority.value).set(depth.length)
            self.queue_pending.labels(priority=priority.value).set(depth.pending)
        self.live_workers.set(live_workers)

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestClock:
    """Times one request's tokens into ``metrics``; ``start`` is ``time.monotonic()`` at submit.

    A request without ``live`` events hears its first event when it is sent and the rest at its end,
    so it adds its time to first token but no inter-token latencies.
    """

    def __init__(self, metrics: GatewayMetrics, start: float, *, live: bool = True) -> None:
        self._metrics = metrics
        self._start = start
        self._live = live
        self._last: float | None = None

    def on_tokens(self, count: int) -> None:
        """A token event with ``count`` tokens arrived now."""
        now = time.monotonic()
        if self._last is None:
            self._metrics.time_to_first_token.observe(now - self._start)
        elif self._live:
            self._metrics.inter_token_latency.observe(now - self._last)
        self._last = now
        self._metrics.generation_tokens.inc(count)

    def on_choice_finished(self, reason: FinishReason) -> None:
        """A choice finished for ``reason``."""
        self._metrics.finished.labels(finished_reason=reason.value).inc()

    def on_request_finished(self, prompt_tokens: int) -> None:
        """Every choice of the request finished."""
        self._metrics.prompt_tokens.inc(prompt_tokens)
        self._metrics.e2e_latency.observe(time.monotonic() - self._start)


class ResponseCounter:
    """ASGI middleware counting responses of ``endpoints`` (path -> label) into ``metrale_requests_total``."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, endpoints: Mapping[str, str]) -> None:
        self._app = app
        self._metrics = metrics
        self._endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self._endpoints.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self._app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._metrics.requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        await self._app(scope, receive, counting_send)
