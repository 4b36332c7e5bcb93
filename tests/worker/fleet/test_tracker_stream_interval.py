"""``RequestTracker.stream_interval``: a choice's tokens go out in events of at least that many, its first
event at once and its last with whatever is left; the events, put together, are exactly the outputs
(tokens and logprobs in order, ``seq`` without gaps), for any interval and any sizes of outputs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from metrale.shared.messages import FinishReason, GenerateRequest, TokenEvent
from metrale.worker.engine.request import RequestOutput
from metrale.worker.fleet.tracker import RequestTracker
from metrale.worker.scheduler.sequence import FinishReason as EngineFinishReason


def output(tokens: list[int], *, choice: int = 0, finished: bool = False) -> RequestOutput:
    reason = EngineFinishReason.LENGTH if finished else None
    logprobs = tuple(-float(token) for token in tokens)
    top = tuple(((token, -float(token)),) for token in tokens)
    return RequestOutput("r", choice, tuple(tokens), logprobs, top, finished, reason, 3)


def tracker(interval: int, n: int = 1) -> RequestTracker:
    message = GenerateRequest("r", "m", "t", [1, 2, 3], max_tokens=64, n=n, logprobs=1)
    return RequestTracker(message, "w", stream_interval=interval)


def emitted(tracker: RequestTracker, outputs: list[RequestOutput]) -> list[TokenEvent]:
    return [event for out in outputs if (event := tracker.on_output(out)) is not None]


def test_tokens_leave_in_fours_after_the_first() -> None:
    steps = [output([10 + step]) for step in range(9)] + [output([19], finished=True)]
    events = emitted(tracker(4), steps)
    assert [event.token_ids for event in events] == [[10], [11, 12, 13, 14], [15, 16, 17, 18], [19]]
    assert [event.seq for event in events] == [0, 1, 2, 3]
    assert events[1].logprobs == [-11.0, -12.0, -13.0, -14.0]
    assert events[1].top_logprobs == [[(11, -11.0)], [(12, -12.0)], [(13, -13.0)], [(14, -14.0)]]
    final = events[-1]
    assert final.finish_reason is FinishReason.LENGTH and final.usage is not None
    assert final.usage.completion_tokens == 10


def test_held_tokens_leave_when_taken_or_with_an_early_finish() -> None:
    tracked = tracker(8)
    assert emitted(tracked, [output([5]), output([6]), output([7])])[0].token_ids == [5]
    assert tracked.unsent
    (taken,) = tracked.take_unsent()
    assert (taken.seq, taken.token_ids, taken.finished) == (1, [6, 7], False)
    assert not tracked.unsent and tracked.take_unsent() == []
    assert tracked.on_output(output([8])) is None
    (last,) = tracked.finish_all(FinishReason.ABORT)
    assert (last.seq, last.token_ids, last.finish_reason) == (2, [8], FinishReason.ABORT)
    assert last.usage is not None and last.usage.completion_tokens == 4


def test_each_choice_holds_its_own_tokens() -> None:
    tracked = tracker(2, n=2)
    events = emitted(tracked, [output([1], choice=0), output([2], choice=1), output([3], choice=0)])
    assert [(event.index, event.token_ids) for event in events] == [(0, [1]), (1, [2])]
    events = emitted(tracked, [output([4], choice=0), output([5], choice=1, finished=True)])
    assert [(event.index, event.token_ids, event.finished) for event in events] == [(0, [3, 4], False), (1, [5], True)]


@given(
    interval=st.integers(1, 6),
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=30),
    take_at=st.sets(st.integers(0, 29)),
)
def test_the_events_are_the_outputs_in_order(interval: int, sizes: list[int], take_at: set[int]) -> None:
    tracked = tracker(interval)
    outputs, events, next_token = [], [], 100
    for step, size in enumerate(sizes):
        finished = step == len(sizes) - 1
        out = output(list(range(next_token, next_token + size)), finished=finished)
        next_token += size
        outputs.append(out)
        events += emitted(tracked, [out])
        if step in take_at and not finished:
            events += tracked.take_unsent()
    assert [event.seq for event in events] == list(range(len(events)))
    assert [t for event in events for t in event.token_ids] == [t for out in outputs for t in out.token_ids]
    assert [lp for event in events for lp in event.logprobs or []] == [lp for out in outputs for lp in out.logprobs]
    assert events[-1].finished and not tracked.unsent
    for event in events[1:-1]:  # between the first and the last, only a take sends fewer
        assert len(event.token_ids) >= interval or take_at
