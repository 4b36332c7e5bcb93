"""The adaptive draft length: how many draft tokens each decoding choice verifies per step, against an
exhaustive search, under acceptance that falls and recovers, and as the batch grows."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.worker.engine.draft_length import (
    CPU_STEP_COST,
    MAX_PROBE_INTERVAL,
    PROBE_INTERVAL,
    DraftLengths,
    StepCost,
    expected_work,
    optimal_draft_counts,
)
from metrale.worker.scheduler.sequence import SequenceId

COST = StepCost(decode_row=0.1, verify_row=0.3)


def _best_ratio(rates: list[float], caps: list[int], rows: int, cost: StepCost) -> float:
    """The plain reference: the best expected work per cost over every assignment of draft counts."""
    return max(
        expected_work(rates, list(counts), rows) / cost.of(rows, rates, counts)
        for counts in itertools.product(*(range(cap + 1) for cap in caps))
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 4)), min_size=1, max_size=4),
    st.integers(0, 6),
    st.sampled_from(
        [
            COST,
            CPU_STEP_COST,
            StepCost(0.3, 0.1),
            StepCost(1.0, 1.0),
            StepCost(0.1, 0.2, 0.0, 2.0),
            StepCost(0.1, 0.1, 1.5),
        ]
    ),
)
def test_greedy_draft_counts_reach_the_exhaustive_optimum(
    choices: list[tuple[float, int]], other_rows: int, cost: StepCost
) -> None:
    rates, caps = [rate for rate, _ in choices], [cap for _, cap in choices]
    rows = len(choices) + other_rows
    counts = optimal_draft_counts(rates, caps, rows, cost)
    assert all(0 <= count <= cap for count, cap in zip(counts, caps, strict=True))
    ratio = expected_work(rates, counts, rows) / cost.of(rows, rates, counts)
    assert ratio == pytest.approx(_best_ratio(rates, caps, rows, cost), rel=1e-9)


def test_a_choice_always_accepted_keeps_its_longest_draft() -> None:
    lengths, seq = DraftLengths(COST), SequenceId("r", 0)
    for _ in range(20):
        (count,) = lengths.lengths([(seq, 4)])
        assert count == 4
        lengths.record(seq, count, count)


def test_a_choice_never_accepted_falls_to_none_and_probes_ever_more_rarely() -> None:
    lengths, seq = DraftLengths(COST), SequenceId("r", 0)
    drafted_at = []
    for step in range(400):
        (count,) = lengths.lengths([(seq, 4)])
        if count:
            drafted_at.append(step)
            lengths.record(seq, count, 0)
    assert drafted_at[0] == 0 and lengths.estimate(seq).probe_interval == MAX_PROBE_INTERVAL
    gaps = [b - a for a, b in itertools.pairwise(drafted_at)]
    probes = [gap for gap in gaps if gap > 1]
    assert probes[:3] == [PROBE_INTERVAL, 2 * PROBE_INTERVAL, 4 * PROBE_INTERVAL]
    assert len(drafted_at) < 15  # 400 decode steps; a draft each would cost 400 verify rows or more


def test_a_probe_that_is_accepted_brings_the_drafts_back() -> None:
    lengths, seq = DraftLengths(COST), SequenceId("r", 0)
    for _ in range(40):  # drafts miss: down to probes
        (count,) = lengths.lengths([(seq, 4)])
        lengths.record(seq, count, 0)
    counts = []
    for _ in range(60):  # now every draft token is accepted
        (count,) = lengths.lengths([(seq, 4)])
        lengths.record(seq, count, count)
        counts.append(count)
    assert counts[-1] == 4 and lengths.estimate(seq).probe_interval == PROBE_INTERVAL


def test_a_lone_row_drafts_only_as_many_as_pay_for_its_dearer_first_token() -> None:
    """One decoding choice alone: its first draft token costs ``lone_verify`` more, so a middling acceptance
    drafts several tokens or none, never a lone one that cannot pay."""
    cost = StepCost(0.1, 0.25, 0.0, 0.45)
    assert optimal_draft_counts([1.0], [4], 1, cost) == [4]
    assert optimal_draft_counts([0.7], [4], 1, cost) == [3]
    assert optimal_draft_counts([0.7], [1], 1, cost) == [0]  # 1.7 tokens for 1.7 lone steps: no gain
    assert optimal_draft_counts([0.4], [4], 1, cost) == [0]
    assert optimal_draft_counts([0.7, 0.7], [4, 4], 2, cost) == [1, 1]  # two rows pay no lone_verify


def test_rejections_that_cost_more_shorten_the_draft() -> None:
    """A rejected draft costs ``rejected_verify`` more (a state copied back): the likelier a rejection,
    the fewer tokens pay; a sure draft pays none of it."""
    cheap, dear = StepCost(0.1, 0.25), StepCost(0.1, 0.25, rejected_verify=2.0)
    assert optimal_draft_counts([1.0], [4], 1, dear) == optimal_draft_counts([1.0], [4], 1, cheap) == [4]
    assert optimal_draft_counts([0.7], [4], 1, cheap) == [2]
    assert optimal_draft_counts([0.7], [4], 1, dear) == [0]
    assert dear.verify(1.0, 3, 2) == cheap.verify(1.0, 3, 2) == 0.75


def test_speculation_backs_off_once_the_batch_is_compute_bound() -> None:
    """Choices whose every draft token is accepted: all draft below ``compute_bound_rows`` decode rows, none
    from it on; prefill rows in the step count towards it."""
    bound = COST.compute_bound_rows
    assert bound == 5 and CPU_STEP_COST.compute_bound_rows == 7
    lengths = DraftLengths(COST)
    for rows in range(1, 12):
        caps = [(SequenceId(f"r{i}", 0), 4) for i in range(rows)]
        drafted = sum(lengths.lengths(caps))
        assert (drafted > 0) == (rows < bound), rows
    assert sum(lengths.lengths([(SequenceId("r0", 0), 4)], other_rows=bound)) == 0
    assert all(lengths.estimate(seq_id).probe_interval == PROBE_INTERVAL for seq_id, _ in caps)


def test_a_compute_bound_batch_does_not_probe() -> None:
    lengths = DraftLengths(COST)
    caps = [(SequenceId(f"r{i}", 0), 4) for i in range(COST.compute_bound_rows)]
    for _ in range(3 * MAX_PROBE_INTERVAL):
        assert sum(lengths.lengths(caps)) == 0


def test_forget_drops_every_choice_of_a_request() -> None:
    lengths = DraftLengths(COST)
    for seq_id in (SequenceId("a", 0), SequenceId("a", 1), SequenceId("b", 0)):
        lengths.record(seq_id, 4, 0)
    lengths.forget("a")
    assert lengths.estimate(SequenceId("a", 1)).rate == 1.0
    assert lengths.estimate(SequenceId("b", 0)).rate < 1.0


@pytest.mark.parametrize(
    "cost",
    [(0.0, 0.3, 0.0, 0.0), (1.5, 0.3, 0.0, 0.0), (0.1, 0.0, 0.0, 0.0), (0.1, 0.3, -0.1, 0.0), (0.1, 0.3, 0.0, -1.0)],
)
def test_step_cost_refuses_a_model_it_cannot_use(cost: tuple[float, float, float, float]) -> None:
    with pytest.raises(ValueError, match="step cost"):
        StepCost(*cost)
