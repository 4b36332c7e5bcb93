"""The soak benchmark's load: interactive streamed chat completions (the official ``openai`` client, no
retries) at a fixed concurrency, and batches through ``/v1/files`` + ``/v1/batches`` one after another.

Every request gets exactly one ``Outcome``: ``ok`` (its whole output, with a finish reason; a
``length`` finish with as many tokens as asked), ``error`` (a clear one: an HTTP status or an error
event with a message), or a loss — ``truncated`` (the stream ended with neither), ``dropped`` (the
connection broke without an error message), ``timeout`` (no end within the client's deadline). Bodies
come from a small seeded pool and repeat, so every ``ok`` answer is compared with the first answer
to the same body: seeded sampling and greedy decoding must give the same text however often a worker
dies under it. Every line of every batch must appear exactly once in its output or error file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

LOSSES = ("truncated", "dropped", "timeout")
WORDS = ["alpha", "beta", "gamma", "delta", "fleet", "worker", "stream", "token", "state", "redis", "queue"]
POLL_S = 1.0


@dataclass
class Outcome:
    """How one request ended."""

    kind: str  # "interactive" | "batch-line" | "batch"
    key: str  # the body's id in the pool (same key: same answer expected)
    outcome: str  # "ok" | "error" | one of LOSSES
    started_s: float
    seconds: float
    finish_reason: str | None = None
    status: int | None = None
    message: str = ""
    text: str = ""


@dataclass
class Ledger:
    """Every outcome, and the first ``ok`` text of each body for the consistency check."""

    outcomes: list[Outcome] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)
    reference: dict[str, str] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    poll_errors: int = 0

    def count_sent(self, kind: str, n: int = 1) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + n

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        if outcome.outcome != "ok":
            return
        first = self.reference.setdefault(f"{outcome.kind}:{outcome.key}", outcome.text)
        if first != outcome.text:
            self.mismatches.append(f"{outcome.kind} {outcome.key}: {first[:40]!r} then {outcome.text[:40]!r}")


def chat_pool(model: str, size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` chat bodies: a few words to answer, half greedy, half seeded sampling, 8-48 tokens."""
    rng = random.Random(seed)
    pool = []
    for i in range(size):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 24)))
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": f"{i}: {words}"}]}
        body["max_tokens"] = rng.choice([8, 16, 32, 48])
        body |= {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": rng.randrange(1 << 30)}
        pool.append(body)
    return pool


class Interactive:
    """``concurrency`` loops, each streaming one pooled body after another until ``stop`` is set."""

    def __init__(self, base_url: str, api_key: str, pool: list[dict[str, Any]], ledger: Ledger, timeout_s: float):
        self.client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s)
        self.pool, self.ledger, self.timeout_s = pool, ledger, timeout_s
        self.clock = time.monotonic()

    async def run(self, concurrency: int, stop: asyncio.Event, seed: int) -> None:
        await asyncio.gather(*(self._loop(stop, random.Random(seed * 1000 + i)) for i in range(concurrency)))
        await self.client.close()

    async def _loop(self, stop: asyncio.Event, rng: random.Random) -> None:
        while not stop.is_set():
            index = rng.randrange(len(self.pool))
            self.ledger.count_sent("interactive")
            self.ledger.add(await self.one(index))

    async def one(self, index: int) -> Outcome:
        body = self.pool[index]
        started = time.monotonic()
        result = Outcome("interactive", str(index), "truncated", started - self.clock, 0.0)
        try:
            await asyncio.wait_for(self._stream(body, result), self.timeout_s + 10)
        except openai.APIStatusError as error:
            result.outcome, result.status, result.message = "error", error.status_code, _message(error)
        except openai.APITimeoutError:
            result.outcome, result.message = "timeout", "no answer within the client's timeout"
        except TimeoutError:
            result.outcome, result.message = "timeout", "no end of stream within the client's timeout"
        except openai.APIConnectionError as error:
            result.outcome, result.message = "dropped", f"{type(error).__name__}: {error}"
        except openai.APIError as error:  # an error event in the stream: a clear error
            result.outcome, result.message = "error", _message(error)
        result.seconds = time.monotonic() - started
        return result

    async def _stream(self, body: dict[str, Any], result: Outcome) -> None:
        stream = await self.client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            for choice in chunk.choices:
                result.text += choice.delta.content or ""
                result.finish_reason = choice.finish_reason or result.finish_reason
            usage = chunk.usage or usage
        if result.finish_reason is None:
            result.message = "the stream ended without a finish reason or an error"
            return
        if result.finish_reason == "length" and (usage is None or usage.completion_tokens != body["max_tokens"]):
            result.message = f"finish_reason length after {usage and usage.completion_tokens} tokens"
            return
        result.outcome = "ok"


def _message(error: openai.APIError) -> str:
    return str(error.message)[:300]


@dataclass
class Batches:
    """Batches of ``lines`` chat lines (the same lines every time) submitted one after another."""

    base_url: str
    api_key: str
    pool: list[dict[str, Any]]
    ledger: Ledger
    deadline_s: float
    clock: float = field(default_factory=time.monotonic)
    submitted: int = 0
    ended: dict[str, int] = field(default_factory=dict)

    async def run(self, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=60) as http:
            while not stop.is_set():
                await self.one(http)

    async def one(self, http: httpx.AsyncClient) -> None:
        started = time.monotonic()
        self.ledger.count_sent("batch")
        outcome = Outcome("batch", "batch", "error", started - self.clock, 0.0)
        try:
            batch_id, input_id = await self._submit(http)
        except httpx.HTTPStatusError as error:
            outcome.status, outcome.message = error.response.status_code, error.response.text[:300]
        except httpx.HTTPError as error:
            outcome.outcome, outcome.message = "dropped", f"{type(error).__name__}: {error}"
        else:
            self.submitted += 1
            self.ledger.count_sent("batch-line", len(self.pool))
            outcome = await self._follow(http, batch_id, input_id, outcome)
        outcome.seconds = time.monotonic() - started
        self.ledger.add(outcome)
        if outcome.outcome != "ok":
            await asyncio.sleep(2)

    async def _submit(self, http: httpx.AsyncClient) -> tuple[str, str]:
        lines = [
            {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            for i, body in enumerate(self.pool)
        ]
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = await http.post("/v1/files", files={"file": ("soak.jsonl", content)}, data={"purpose": "batch"})
        uploaded.raise_for_status()
        input_id = uploaded.json()["id"]
        body = {"input_file_id": input_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        created = await http.post("/v1/batches", json=body)
        created.raise_for_status()
        return str(created.json()["id"]), input_id

    async def _follow(self, http: httpx.AsyncClient, batch_id: str, input_id: str, outcome: Outcome) -> Outcome:
        outcome.key = batch_id
        deadline = time.monotonic() + self.deadline_s
        batch: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                answer = await http.get(f"/v1/batches/{batch_id}")
                answer.raise_for_status()
                batch = answer.json()
            except httpx.HTTPError:
                self.ledger.poll_errors += 1  # Redis restarting: ask again
            if batch.get("status") in ("completed", "failed", "cancelled", "expired"):
                break
            await asyncio.sleep(POLL_S)
        else:
            outcome.outcome, outcome.message = "timeout", f"{batch_id} still {batch.get('status')}"
            self.ledger.missing += [f"{batch_id}/line-{i}" for i in range(len(self.pool))]
            return outcome
        status = batch["status"]
        self.ended[status] = self.ended.get(status, 0) + 1
        outcome.finish_reason = status
        await self._check_lines(http, batch)
        await _delete(http, [input_id, batch.get("output_file_id"), batch.get("error_file_id")])
        outcome.outcome = "ok" if status == "completed" else "error"
        return outcome

    async def _check_lines(self, http: httpx.AsyncClient, batch: dict[str, Any]) -> None:
        """Every line once in the output or error file, each an answer or a clear error."""
        seen: dict[str, dict[str, Any]] = {}
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            if not file_id:
                continue
            text = (await _get_retrying(http, f"/v1/files/{file_id}/content")).text
            for raw in text.splitlines():
                line = json.loads(raw)
                if line["custom_id"] in seen:
                    self.ledger.duplicates.append(f"{batch['id']}/{line['custom_id']}")
                seen[line["custom_id"]] = line
        for i in range(len(self.pool)):
            custom_id = f"line-{i}"
            line = seen.get(custom_id)
            if line is None:
                self.ledger.missing.append(f"{batch['id']}/{custom_id}")
                continue
            self.ledger.add(line_outcome(custom_id, line, time.monotonic() - self.clock, self.pool[i]))


def line_outcome(custom_id: str, line: dict[str, Any], at_s: float, body: dict[str, Any]) -> Outcome:
    """A batch output or error line as an ``Outcome``."""
    result = Outcome("batch-line", custom_id, "error", at_s, 0.0)
    response, error = line.get("response"), line.get("error")
    if response is not None and response.get("status_code") == 200:
        answer = response["body"]
        choice = answer["choices"][0]
        result.finish_reason, result.text = choice["finish_reason"], choice["message"]["content"] or ""
        full = choice["finish_reason"] != "length" or answer["usage"]["completion_tokens"] == body["max_tokens"]
        result.outcome = "ok" if choice["finish_reason"] and full else "truncated"
        return result
    if response is not None:
        result.status = response.get("status_code")
        result.message = str((response.get("body") or {}).get("error", {}).get("message", ""))[:300]
    if error:
        result.message = str(error.get("message", error))[:300]
    if not result.message:
        result.outcome = "dropped"  # an error line that says nothing
    return result


async def _get_retrying(http: httpx.AsyncClient, path: str, attempts: int = 10) -> httpx.Response:
    for attempt in range(attempts):
        try:
            answer = await http.get(path)
            answer.raise_for_status()
            return answer
        except httpx.HTTPError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(1)
    raise AssertionError("unreachable")


async def _delete(http: httpx.AsyncClient, file_ids: list[str | None]) -> None:
    for file_id in file_ids:
        if file_id:
            with contextlib.suppress(httpx.HTTPError):
                await http.delete(f"/v1/files/{file_id}")
