"""What a worker decides from a request's record before continuing it: whether it can, with which
tokens and seed, where its checkpoints may be, and when to give up."""

from __future__ import annotations

import pytest

from metrale.shared.messages import FinishReason, GenerateRequest, TokenEvent
from metrale.shared.record import RunRecord
from metrale.worker.fleet.admission import (
    Continuation,
    continuation,
    continuation_checkpoints,
    engine_request,
    undeliverable,
)

RID = "cmpl-1"


def message(*, n: int = 1, seed: int | None = None) -> GenerateRequest:
    return GenerateRequest(RID, "tiny", "acme", [1, 2, 3], max_tokens=8, n=n, seed=seed)


def record(events: list[TokenEvent], seed: int | None = 99) -> RunRecord:
    return RunRecord(RID, None, "w", None, None, tuple(events), seed)


def event(seq: int, tokens: list[int], index: int = 0, reason: FinishReason | None = None) -> TokenEvent:
    return TokenEvent(RID, index, seq, tokens, "w", finished=reason is not None, finish_reason=reason)


@pytest.mark.parametrize(
    ("sent", "seed", "n", "expected"),
    [
        pytest.param(None, None, 1, Continuation(), id="never-started"),
        pytest.param(record([], seed=5), None, 2, Continuation((), 5), id="started-sent-nothing"),
        pytest.param(record([event(0, [7]), event(1, [8, 9])]), None, 1, Continuation((7, 8, 9), 99), id="sent"),
        pytest.param(record([event(0, [7])], seed=None), 4, 1, Continuation((7,), 4), id="its-own-seed-wins"),
    ],
)
def test_a_request_continues_with_its_emitted_tokens_and_seed(
    sent: RunRecord | None, seed: int | None, n: int, expected: Continuation
) -> None:
    assert continuation(message(n=n, seed=seed), sent) == expected


@pytest.mark.parametrize(
    ("sent", "n", "reason"),
    [
        pytest.param(record([event(0, [7])]), 2, "n > 1", id="several-choices"),
        pytest.param(record([event(0, [7]), event(2, [8])]), 1, "missing events", id="hole-in-record"),
        pytest.param(record([event(0, [7], reason=FinishReason.LENGTH)]), 1, "finished", id="already-finished"),
        pytest.param(record([event(0, [7])], seed=None), 1, "seed", id="no-seed"),
    ],
)
def test_a_request_that_cannot_continue_exactly_says_why(sent: RunRecord, n: int, reason: str) -> None:
    refused = continuation(message(n=n), sent)
    assert isinstance(refused, str) and reason in refused


@pytest.mark.parametrize(
    ("generated", "interval", "positions"),
    [
        pytest.param(0, 4, [], id="nothing-generated"),
        pytest.param(1, 4, [10], id="after-the-prompt"),
        pytest.param(10, 4, [10, 14, 18, 19], id="every-interval-and-the-newest"),
        pytest.param(9, 4, [10, 14, 18], id="newest-on-the-grid"),
        pytest.param(6, 0, [15], id="decode-checkpoints-off"),
    ],
)
def test_a_continued_request_looks_for_its_checkpoints_where_they_were_taken(
    generated: int, interval: int, positions: list[int]
) -> None:
    assert continuation_checkpoints(10, generated, interval) == positions


@pytest.mark.parametrize(("deliveries", "given_up"), [(1, False), (3, False), (4, True)])
def test_a_request_is_given_up_after_more_deliveries_than_allowed(deliveries: int, given_up: bool) -> None:
    assert (undeliverable(deliveries, max_deliveries=3) is not None) is given_up


def test_the_engine_request_of_a_continuation_keeps_the_recorded_seed_and_tokens() -> None:
    request = engine_request(message(), earlier=Continuation((7, 8), 1234))

    assert (request.params.seed, request.generated, request.prompt_ids) == (1234, (7, 8), (1, 2, 3))
