"""``RequestTracker``: a choice the engine refused (its grammar at a dead end) goes out as a final
event with ``finish_reason`` ``refused`` and the engine's reason, and the request's outcome says so."""

from __future__ import annotations

from metrale.shared.messages import FinishReason, GenerateRequest
from metrale.worker.engine.request import RequestOutput
from metrale.worker.fleet.tracker import RequestTracker
from metrale.worker.scheduler.sequence import FinishReason as EngineFinishReason


def output(tokens: tuple[int, ...], reason: EngineFinishReason | None, error: str | None = None) -> RequestOutput:
    return RequestOutput(
        "r", 0, tokens, (0.0,) * len(tokens), ((),) * len(tokens), reason is not None, reason, 3, error
    )


def test_a_refused_choice_ends_with_its_reason() -> None:
    tracker = RequestTracker(GenerateRequest("r", "m", "t", [1, 2, 3], max_tokens=8), "w")
    first = tracker.on_output(output((90,), None))
    last = tracker.on_output(output((), EngineFinishReason.REFUSED, "the constrained output reached a dead end"))
    assert first is not None and first.finish_reason is None and first.error is None
    assert last is not None and last.finished and last.token_ids == []
    assert (last.finish_reason, last.error) == (FinishReason.REFUSED, "the constrained output reached a dead end")
    assert last.usage is not None and last.usage.completion_tokens == 1
    outcome = tracker.outcome()
    assert (outcome.finish_reason, outcome.error) == (FinishReason.REFUSED, "the constrained output reached a dead end")


def test_a_stopped_choice_carries_no_error() -> None:
    tracker = RequestTracker(GenerateRequest("r", "m", "t", [1, 2, 3], max_tokens=8), "w")
    last = tracker.on_output(output((5,), EngineFinishReason.STOP))
    assert last is not None and (last.finish_reason, last.error) == (FinishReason.STOP, None)
