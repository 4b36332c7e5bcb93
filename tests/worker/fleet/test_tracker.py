"""``RequestTracker``: a choice the engine refused (its grammar at a dead end) goes out as a final
event with ``finish_reason`` ``refused`` and the engine's reason, and the request's outcome says so;
prompt logprobs go out once per position, also for a request continued from another worker's record."""

from __future__ import annotations

from metrale.shared.messages import FinishReason, GenerateRequest, TokenEvent
from metrale.shared.record import RunRecord
from metrale.worker.engine.prompt_logprobs import PromptLogprobs
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


def prompt_output(start: int, logprobs: tuple[float, ...]) -> RequestOutput:
    scored = PromptLogprobs(start, logprobs, tuple(((7, lp),) for lp in logprobs))
    return RequestOutput("r", 0, (), (), (), False, None, 6, prompt_logprobs=scored)


def test_prompt_logprobs_go_out_once_each_in_order() -> None:
    message = GenerateRequest("r", "m", "t", [1, 2, 3, 4, 5, 6], max_tokens=8, prompt_logprobs=1)
    tracker = RequestTracker(message, "w")
    first = tracker.on_output(prompt_output(1, (-1.0, -2.0)))
    assert first is not None and first.prompt_logprobs == [-1.0, -2.0] and first.seq == 0
    assert first.prompt_top_logprobs == [[(7, -1.0)], [(7, -2.0)]]
    assert not tracker.prompt_logprobs_sent
    second = tracker.on_output(prompt_output(3, (-3.0, -4.0, -5.0)))
    assert second is not None and second.prompt_logprobs == [-3.0, -4.0, -5.0] and second.seq == 1
    assert tracker.prompt_logprobs_sent


def test_a_continued_request_sends_only_the_prompt_logprobs_its_record_lacks() -> None:
    message = GenerateRequest("r", "m", "t", [1, 2, 3, 4, 5, 6], max_tokens=8, prompt_logprobs=0)
    sent = TokenEvent("r", 0, 0, [], "lost", prompt_logprobs=[-1.0, -2.0])
    tracker = RequestTracker.continuing(message, "w", RunRecord("r", None, "lost", None, None, (sent,)))
    assert tracker.on_output(prompt_output(1, (-1.0,))) is None  # scored again by the new prefill
    event = tracker.on_output(prompt_output(2, (-2.0, -3.0, -4.0)))
    assert event is not None and (event.seq, event.prompt_logprobs, event.prompt_top_logprobs) == (
        1,
        [-3.0, -4.0],
        None,
    )
    assert tracker.on_output(prompt_output(4, (-4.0, -5.0))) is not None
    assert tracker.prompt_logprobs_sent
