"""Workers with checkpoints on a real Redis: turn 2 of a session resumes on another worker, exactly."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from pathlib import Path

import pytest
import redis

from metrale.shared.keys import Keys
from metrale.shared.messages import GenerateRequest
from metrale.shared.record import RunRecord
from metrale.shared.settings import WorkerSettings
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.fleet.assembly import build_worker
from metrale.worker.fleet.broker.redis_transport import redis_client
from tests.worker.fleet.test_service_redis import finished_record, submit
from tests.worker.worker_helpers import join_worker, start_worker, tokens_of, worker_settings

LIMITS = EngineLimits(max_seqs=4, max_batch_tokens=64, num_blocks=64, checkpoint_grid=32)


def _serve_one(
    client: redis.Redis, settings: WorkerSettings, model_dir: Path, name: str, message: GenerateRequest
) -> RunRecord:
    """Run a fresh worker named ``name`` until it has served ``message``; return the request's record."""
    worker = build_worker(settings, client, directory=model_dir, served_name="tiny", worker_id=name, limits=LIMITS)
    stop = threading.Event()
    thread = start_worker(worker, stop)
    submit(client, settings.keys, message)
    record = finished_record(client, settings.keys, message.request_id)
    stop.set()
    join_worker(thread, stop)
    return record


@pytest.mark.redis
@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
def test_second_turn_resumes_on_another_worker(real_redis_url: str, tiny_model_dir: Path, seed: int | None) -> None:
    keys = Keys(f"met-test-{uuid.uuid4().hex}")
    settings = dataclasses.replace(worker_settings(), namespace=keys.namespace)
    client = redis_client(real_redis_url)
    temperature = 0.0 if seed is None else 0.9
    turn1_prompt = list(range(100, 170))
    turn1 = GenerateRequest(
        "chatcmpl-t1",
        "tiny",
        "acme",
        turn1_prompt,
        max_tokens=10,
        temperature=temperature,
        seed=seed,
        ignore_eos=True,
        session_id="conv-1",
    )
    first = _serve_one(client, settings, tiny_model_dir, "worker-a", turn1)
    reply = tokens_of(first.events, 0)
    assert first.events[-1].usage is not None and first.events[-1].usage.cached_tokens == 0

    turn2_prompt = [*turn1_prompt, *reply, *range(200, 230)]
    turn2 = dataclasses.replace(turn1, request_id="chatcmpl-t2", prompt_token_ids=turn2_prompt)
    second = _serve_one(client, settings, tiny_model_dir, "worker-b", turn2)
    usage = second.events[-1].usage
    assert usage is not None and usage.cached_tokens == len(turn1_prompt) + len(reply) - 1
    assert {e.worker_id for e in second.events} == {"worker-b"}

    cold = build_engine(tiny_model_dir, LIMITS).engine.generate(
        [turn2_prompt], SamplingParams(max_tokens=10, temperature=temperature, seed=seed, ignore_eos=True)
    )
    assert tokens_of(second.events, 0) == cold[0].completions[0].token_ids
    counters = {k.decode(): int(v) for k, v in client.hgetall(keys.checkpoint_counters()).items()}
    assert counters["hits"] >= 1 and counters["tokens_reused"] >= usage.cached_tokens
    client.delete(*client.scan_iter(f"{keys.namespace}:*"))
    client.close()


@pytest.mark.redis
def test_only_a_session_keeps_the_state_at_its_end(real_redis_url: str, tiny_model_dir: Path) -> None:
    """A request outside a session leaves no checkpoint a later request could not find: none at its end,
    and its decode checkpoint (the state after its prompt, kept for failover) is gone once it ends."""
    keys = Keys(f"met-test-{uuid.uuid4().hex}")
    settings = dataclasses.replace(worker_settings(), namespace=keys.namespace)
    client = redis_client(real_redis_url)
    prompt = list(range(100, 120))  # below the grid (32): no prompt checkpoint either
    alone = GenerateRequest("cmpl-alone", "tiny", "acme", prompt, max_tokens=10, temperature=0.0, ignore_eos=True)
    in_session = dataclasses.replace(alone, request_id="cmpl-session", session_id="conv-1")

    def checkpoints() -> list[bytes]:
        return sorted(client.scan_iter(f"{keys.namespace}:ckpt:*"))

    try:
        _serve_one(client, settings, tiny_model_dir, "worker-a", alone)
        assert checkpoints() == []
        record = _serve_one(client, settings, tiny_model_dir, "worker-a", in_session)
        assert len(checkpoints()) == 1  # the state after the prompt and all but the last reply token
        turn2 = dataclasses.replace(
            in_session, request_id="cmpl-turn2", prompt_token_ids=[*prompt, *tokens_of(record.events, 0), 7]
        )
        usage = _serve_one(client, settings, tiny_model_dir, "worker-b", turn2).events[-1].usage
        assert usage is not None and usage.cached_tokens == len(prompt) + 10 - 1
    finally:
        client.delete(*client.scan_iter(f"{keys.namespace}:*"))
        client.close()
