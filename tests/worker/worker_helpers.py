"""What the worker-loop tests share: an engine over the recording fake, its announcement, settings,
requests, and the expected tokens of each choice (``isolated_run``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from metrale.shared.messages import FinishReason, GenerateRequest, ModelAnnouncement, TokenEvent
from metrale.shared.settings import KernelBackend, WorkerSettings
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.fleet.service import Worker
from metrale.worker.scheduler.config import SchedulerConfig
from tests.worker.fakes import VOCAB_SIZE, RecordingModel, isolated_run

EOS = 30
MODEL = "fake-model"
MAX_MODEL_LEN = 64
JOIN_TIMEOUT_S = 30


def make_engine(max_seqs: int = 4, max_model_len: int = MAX_MODEL_LEN) -> tuple[Engine, RecordingModel]:
    block_size = 4
    config = SchedulerConfig(
        max_batch_tokens=64,
        max_seqs=max_seqs,
        num_slots=max_seqs,
        num_blocks=max_seqs * (max_model_len // block_size + 1),
        block_size=block_size,
        max_model_len=max_model_len,
    )
    model = RecordingModel(config.num_slots, config.num_blocks, config.block_size)
    return Engine(model, config, eos_token_ids=[EOS]), model


def announcement(max_model_len: int = MAX_MODEL_LEN) -> ModelAnnouncement:
    return ModelAnnouncement(MODEL, "{}", "{}", max_model_len, VOCAB_SIZE, [EOS], "0" * 64)


def worker_settings(*, drain_timeout_s: float = 30.0, heartbeat_ttl_s: int = 10) -> WorkerSettings:
    return WorkerSettings(
        redis_url=None,
        model_dir=None,
        checkpoint_dir=None,
        kernels=KernelBackend.TORCH,
        heartbeat_ttl_s=heartbeat_ttl_s,
        drain_timeout_s=drain_timeout_s,
    )


def generate_request(request_id: str, prompt: Sequence[int] = (1, 2, 3), **fields: Any) -> GenerateRequest:
    fields = {"max_tokens": 6, "seed": 7, **fields}
    return GenerateRequest(request_id, fields.pop("model", MODEL), "default", list(prompt), **fields)


def start_worker(worker: Worker, stop: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    return thread


def join_worker(thread: threading.Thread, stop: threading.Event) -> None:
    """Wait for a worker thread to return by itself; fail (and stop it) if it does not."""
    thread.join(JOIN_TIMEOUT_S)
    if thread.is_alive():
        stop.set()
        thread.join(JOIN_TIMEOUT_S)
        pytest.fail("the worker did not finish in time")


def run_worker(worker: Worker, stop: threading.Event) -> None:
    """Run ``worker`` in a thread until it returns by itself."""
    join_worker(start_worker(worker, stop), stop)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def expected_choice(
    message: GenerateRequest, choice: int, max_model_len: int = MAX_MODEL_LEN
) -> tuple[list[int], FinishReason]:
    assert message.seed is not None
    params = SamplingParams(
        max_tokens=message.max_tokens, seed=message.seed, n=message.n, ignore_eos=message.ignore_eos
    )
    stops = frozenset() if message.ignore_eos else frozenset({EOS})
    tokens, reason = isolated_run(message.prompt_token_ids, params, message.seed, choice, stops, max_model_len)
    return tokens, FinishReason(reason.value)


def tokens_of(events: Sequence[TokenEvent], choice: int) -> list[int]:
    return [token for event in events if event.index == choice for token in event.token_ids]
