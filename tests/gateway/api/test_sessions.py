"""Sessions through the gateway with real workers on a real Redis (one, and a Redis Cluster): turn N
costs only its new tokens, on whichever worker serves it, and changes no output."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
import redis.asyncio

from metrale.gateway.app import create_app
from metrale.shared.keys import Keys
from metrale.shared.record import read_record
from metrale.shared.redis_connect import connect_async, connect_sync
from metrale.shared.settings import GatewaySettings
from metrale.worker.engine.factory import EngineLimits
from metrale.worker.fleet.assembly import build_worker
from tests.worker.worker_helpers import worker_settings

pytestmark = pytest.mark.anyio

TURNS = 8
MODEL = "tiny"
WORDS = [
    "the",
    "keeper",
    "of",
    "the",
    "light",
    "walked",
    "along",
    "the",
    "shore",
    "counting",
    "waves",
    "and",
    "gulls",
    "before",
    "dawn",
]


def _user_text(turn: int) -> str:
    rng = random.Random(turn)
    return " ".join(rng.choice(WORDS) for _ in range(170)) + f" (turn {turn})"


@dataclasses.dataclass
class Turn:
    reply: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    worker: str


class Fleet:
    """A gateway (ASGI, in-process) plus one worker thread at a time, on a real Redis (the test Redis, or a
    Redis Cluster: keys sharded as the fleet's processes shard them there)."""

    def __init__(self, redis_url: str, model_dir: Path, checkpoints: bool) -> None:
        self.keys = Keys.for_redis(redis_url, f"met-test-{uuid.uuid4().hex[:12]}")
        self.redis_url, self.model_dir, self.checkpoints = redis_url, model_dir, checkpoints
        # A cluster's client answers the same calls (the gateway's and record readers' types name one Redis).
        self.sync = cast(redis.Redis, connect_sync(redis_url))

    @contextlib.contextmanager
    def worker(self, name: str) -> Iterator[None]:
        settings = dataclasses.replace(
            worker_settings(heartbeat_ttl_s=5), namespace=self.keys.namespace, redis_url=self.redis_url
        )
        limits = EngineLimits(max_seqs=4, max_batch_tokens=512, num_blocks=512, checkpoint_grid=256)
        worker = build_worker(
            settings,
            connect_sync(self.redis_url),  # its own: a worker closes its client when it stops
            directory=self.model_dir,
            served_name=MODEL,
            worker_id=name,
            limits=limits,
            checkpoints=self.checkpoints,
        )
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not self.sync.exists(self.keys.worker(name)):
            assert time.monotonic() < deadline, "the worker did not come up"
            time.sleep(0.02)
        try:
            yield
        finally:
            stop.set()
            thread.join(30)

    def gateway_settings(self) -> GatewaySettings:
        return GatewaySettings(
            redis_url=self.redis_url,
            api_keys={},
            request_timeout_s=120,
            max_queue=100,
            heartbeat_ttl_s=5,
            namespace=self.keys.namespace,
        )

    def close(self) -> None:
        if keys := list(self.sync.scan_iter(f"{self.keys.namespace}:*")):
            self.sync.delete(*keys)
        self.sync.close()


async def _conversation(fleet: Fleet, sampling: dict[str, Any]) -> list[Turn]:
    client = cast(redis.asyncio.Redis, connect_async(fleet.redis_url))
    app = create_app(fleet.gateway_settings(), client)
    turns: list[Turn] = []
    messages: list[dict[str, str]] = [{"role": "system", "content": "You keep a lighthouse log."}]
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=120) as http,
    ):
        for turn in range(TURNS):
            messages.append({"role": "user", "content": _user_text(turn)})
            body = {"model": MODEL, "messages": messages, "max_tokens": 40, "ignore_eos": True, **sampling}
            worker_name = f"worker-{'ab'[turn % 2]}"
            with fleet.worker(worker_name):
                response = await http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "log-1"})
            assert response.status_code == 200, response.text
            data = response.json()
            usage = data["usage"]
            record = read_record(fleet.sync, data["id"], keys=fleet.keys)
            assert record is not None
            reply = data["choices"][0]["message"]["content"]
            turns.append(
                Turn(
                    reply,
                    usage["prompt_tokens"],
                    usage["completion_tokens"],
                    usage["prompt_tokens_details"]["cached_tokens"],
                    record.worker_id or "",
                )
            )
            messages.append({"role": "assistant", "content": reply})
    await client.aclose()
    return turns


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95, "seed": 1234}],
    ids=["greedy", "seeded"],
)
async def test_eight_turn_chat_resumes_every_turn_and_changes_nothing(
    any_redis_url: str, tiny_model_dir: Path, sampling: dict[str, Any]
) -> None:
    with_checkpoints = Fleet(any_redis_url, tiny_model_dir, checkpoints=True)
    without = Fleet(any_redis_url, tiny_model_dir, checkpoints=False)
    try:
        warm = await _conversation(with_checkpoints, sampling)
        cold = await _conversation(without, sampling)
    finally:
        with_checkpoints.close()
        without.close()
    assert [t.reply for t in warm] == [t.reply for t in cold]
    assert [t.prompt_tokens for t in warm] == [t.prompt_tokens for t in cold]
    for k in range(1, TURNS):
        new_tokens = warm[k].prompt_tokens - warm[k - 1].prompt_tokens
        assert new_tokens >= 256, f"turn {k + 1} brings only {new_tokens} new tokens"
        assert warm[k].worker != warm[k - 1].worker
        # At least the previous turn's prompt (this model's prompts end in a special token, so their
        # end survives re-tokenization); all of turns 1..k but the last sampled token (never consumed by
        # a state) only when the reply re-tokenized as generated (``test_session_cache.py``).
        previous_total = warm[k - 1].prompt_tokens + warm[k - 1].completion_tokens
        assert warm[k - 1].prompt_tokens <= warm[k].cached_tokens <= previous_total - 1
    assert warm[0].cached_tokens == 0
    assert all(t.cached_tokens == 0 for t in cold)
