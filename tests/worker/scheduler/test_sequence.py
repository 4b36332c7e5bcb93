from __future__ import annotations

import pytest

from metrale.worker.scheduler.sequence import FinishReason, Priority, Sequence, SequenceId, StopParams


def make_seq(prompt: list[int], stop: StopParams) -> Sequence:
    return Sequence(SequenceId("r", 0), prompt, stop, Priority.INTERACTIVE, arrival=0)


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [(0, 3, (10, 11, 12)), (1, 5, (11, 12, 20, 21)), (3, 5, (20, 21)), (4, 5, (21,)), (2, 2, ())],
    ids=["prompt-only", "across-the-seam", "output-only", "last-token", "empty"],
)
def test_tokens_between_spans_prompt_and_output(start: int, end: int, expected: tuple[int, ...]) -> None:
    seq = make_seq([10, 11, 12], StopParams(max_tokens=8))
    seq.output_ids.extend([20, 21])
    assert seq.tokens_between(start, end) == expected


@pytest.mark.parametrize(
    ("include", "output", "emitted"),
    [(True, [5, 7], 7), (False, [5], None)],
    ids=["stop-token-kept", "stop-token-withheld"],
)
def test_stop_token_ends_the_sequence(include: bool, output: list[int], emitted: int | None) -> None:
    seq = make_seq([1], StopParams(max_tokens=8, stop_token_ids=frozenset({7}), include_stop_token=include))
    assert seq.append_sampled(5, max_model_len=64) == (5, None)
    assert seq.append_sampled(7, max_model_len=64) == (emitted, FinishReason.STOP)
    assert seq.output_ids == output


def test_max_tokens_ends_with_length() -> None:
    seq = make_seq([1], StopParams(max_tokens=2))
    assert seq.append_sampled(3, max_model_len=64) == (3, None)
    assert seq.append_sampled(4, max_model_len=64) == (4, FinishReason.LENGTH)


def test_a_stop_token_at_max_tokens_reports_stop() -> None:
    seq = make_seq([1], StopParams(max_tokens=1, stop_token_ids=frozenset({3})))
    assert seq.append_sampled(3, max_model_len=64) == (3, FinishReason.STOP)


def test_max_model_len_ends_once_the_newest_token_could_not_be_fed() -> None:
    seq = make_seq([1, 2, 3], StopParams(max_tokens=8))
    assert seq.append_sampled(4, max_model_len=4) == (4, None)  # fed at position 3, the last one
    assert seq.append_sampled(5, max_model_len=4) == (5, FinishReason.LENGTH)


def test_spawned_choice_starts_after_the_prompt() -> None:
    parent = make_seq([1, 2, 3], StopParams(max_tokens=4))
    child = parent.spawn(2)
    assert child.seq_id == SequenceId("r", 2)
    assert (child.num_computed, child.output_ids, child.prompt_ids) == (3, [], [1, 2, 3])
    assert child.rank > parent.rank


def test_max_tokens_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        StopParams(max_tokens=0)
