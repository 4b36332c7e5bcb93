from __future__ import annotations

import time
from dataclasses import FrozenInstanceError, replace
from typing import Any

import pytest

from metrale.shared.messages import (
    FinishReason,
    GenerateRequest,
    ModelAnnouncement,
    Priority,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
)


def request(**overrides: Any) -> GenerateRequest:
    fields: dict[str, Any] = {
        "request_id": "r-1",
        "model": "tiny",
        "tenant": "acme",
        "prompt_token_ids": [1, 2, 3, 4],
        "max_tokens": 8,
        "created_at": 100.0,
    }
    return GenerateRequest(**(fields | overrides))


def event(**overrides: Any) -> TokenEvent:
    fields: dict[str, Any] = {
        "request_id": "r-1",
        "index": 0,
        "seq": 0,
        "token_ids": [5, 6],
        "worker_id": "w-1",
    }
    return TokenEvent(**(fields | overrides))


def heartbeat(**overrides: Any) -> WorkerHeartbeat:
    fields: dict[str, Any] = {
        "worker_id": "w-1",
        "model": "tiny",
        "running": 2,
        "waiting": 1,
        "swapped": 0,
        "batch_size": 2,
        "tokens_per_s": 40.0,
        "free_slots": 6,
        "free_blocks": 120,
        "started_at": 10.0,
        "sent_at": 20.0,
    }
    return WorkerHeartbeat(**(fields | overrides))


def test_request_defaults_sample_plainly_and_queue_interactively() -> None:
    req = request()
    assert (req.temperature, req.top_p, req.top_k, req.min_p) == (1.0, 1.0, 0, 0.0)
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (req.n, req.seed, req.logprobs, req.session_id, req.deadline) == (1, None, None, None, None)
    assert req.priority is Priority.INTERACTIVE
    assert req.stop_token_ids == [] and req.checkpoint_positions == []


def test_request_created_at_defaults_to_now() -> None:
    before = time.time()
    created = GenerateRequest("r", "m", "t", [1], 1).created_at
    assert before <= created <= time.time()


def test_messages_are_frozen() -> None:
    with pytest.raises(FrozenInstanceError):
        request().max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"prompt_token_ids": []}, "must not be empty", id="empty-prompt"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="zero-max-tokens"),
        pytest.param({"temperature": -0.1}, "temperature", id="negative-temperature"),
        pytest.param({"temperature": float("nan")}, "temperature", id="nan-temperature"),
        pytest.param({"top_p": 0.0}, "top_p", id="zero-top-p"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-above-one"),
        pytest.param({"top_k": -1}, "top_k", id="negative-top-k"),
        pytest.param({"min_p": 1.5}, "min_p", id="min-p-above-one"),
        pytest.param({"repetition_penalty": 0.0}, "repetition_penalty", id="zero-repetition-penalty"),
        pytest.param({"n": 0}, "n must", id="zero-choices"),
        pytest.param({"logprobs": -1}, "logprobs", id="negative-logprobs"),
        pytest.param({"checkpoint_positions": [3, 2]}, "strictly increase", id="positions-unsorted"),
        pytest.param({"checkpoint_positions": [2, 2]}, "strictly increase", id="positions-repeated"),
        pytest.param({"checkpoint_positions": [0]}, "within", id="position-zero"),
        pytest.param({"checkpoint_positions": [5]}, "within", id="position-past-prompt"),
    ],
)
def test_request_rejects_impossible_sampling(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        request(**overrides)


def test_request_accepts_a_checkpoint_at_the_prompt_end() -> None:
    assert request(checkpoint_positions=[1, 4]).checkpoint_positions == [1, 4]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"seq": -1}, "seq", id="negative-seq"),
        pytest.param({"index": -1}, "index", id="negative-index"),
        pytest.param({"finished": True}, "iff finished", id="finished-without-reason"),
        pytest.param({"finish_reason": FinishReason.STOP}, "iff finished", id="reason-without-finished"),
        pytest.param({"usage": Usage(1, 1, 0)}, "final event", id="usage-before-the-end"),
        pytest.param(
            {"finished": True, "finish_reason": FinishReason.STOP, "error": "boom"},
            "requires finish_reason 'error'",
            id="error-with-stop",
        ),
        pytest.param({"logprobs": [-0.1]}, "logprobs must have one entry per token", id="short-logprobs"),
        pytest.param({"top_logprobs": [[], [], []]}, "top_logprobs must have", id="long-top-logprobs"),
    ],
)
def test_token_event_rejects_inconsistent_fields(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        event(**overrides)


def test_final_token_event_may_carry_an_error_and_usage() -> None:
    final = event(finished=True, finish_reason=FinishReason.ERROR, error="worker lost", usage=Usage(4, 2, 1))
    assert final.usage is not None and final.usage.cached_tokens == 1


@pytest.mark.parametrize(
    ("usage", "message"),
    [
        pytest.param((-1, 0, 0), "negative", id="negative-prompt"),
        pytest.param((4, -2, 0), "negative", id="negative-completion"),
        pytest.param((4, 2, 5), "exceeds", id="more-cached-than-prompt"),
    ],
)
def test_usage_rejects_impossible_counts(usage: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Usage(*usage)


@pytest.mark.parametrize("field", ["running", "waiting", "swapped", "batch_size", "free_slots", "free_blocks"])
def test_heartbeat_rejects_negative_counts(field: str) -> None:
    with pytest.raises(ValueError, match="counts"):
        heartbeat(**{field: -1})


def test_heartbeat_rejects_negative_throughput() -> None:
    with pytest.raises(ValueError, match="tokens_per_s"):
        heartbeat(tokens_per_s=-1.0)


def test_model_announcement_keeps_eos_inside_the_vocabulary() -> None:
    announcement = ModelAnnouncement("tiny", "{}", "{}", 4096, 100, [99], "fp-1")
    with pytest.raises(ValueError, match="eos_token_ids"):
        replace(announcement, eos_token_ids=[100])
