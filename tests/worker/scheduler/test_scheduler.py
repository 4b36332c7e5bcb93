"""The planner on small hand-made cases: order, budget, chunking, admission, preemption, forks,
cancellation and limits. States are played by the integer ``StateSimulator``."""

from __future__ import annotations

import pytest

from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.plan import StepPlan
from metrale.worker.scheduler.scheduler import PromptTooLongError, Scheduler
from metrale.worker.scheduler.sequence import FinishReason, Priority, SequenceId, StopParams
from tests.worker.scheduler.simulator import StateSimulator, isolated_tokens, state_nbytes

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


class Harness:
    """A scheduler whose plans are played on integer states; collects every emitted token."""

    def __init__(self, **config: int | None) -> None:
        settings: dict[str, int | None] = {
            "max_batch_tokens": 16,
            "max_seqs": 4,
            "num_slots": 4,
            "num_blocks": 32,
            "block_size": 2,
            "max_model_len": 32,
        }
        self.config = SchedulerConfig(**(settings | config))  # type: ignore[arg-type]
        self.scheduler = Scheduler(self.config, state_nbytes)
        self.simulator = StateSimulator()
        self.emitted: dict[SequenceId, list[int]] = {}
        self.finished: dict[SequenceId, FinishReason] = {}

    def add(
        self, name: str, prompt_len: int, max_tokens: int = 4, priority: Priority = INTERACTIVE, n: int = 1
    ) -> None:
        prompt = [len(name), *range(1, prompt_len)]
        self.scheduler.add(name, prompt, StopParams(max_tokens), priority, n)

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        for update in self.scheduler.postprocess(plan, self.simulator.run(plan)):
            if update.token_id is not None:
                self.emitted.setdefault(update.seq_id, []).append(update.token_id)
            if update.finish_reason is not None:
                self.finished[update.seq_id] = update.finish_reason
        return plan

    def run_to_end(self, max_steps: int = 100) -> list[StepPlan]:
        plans = []
        while self.scheduler.has_unfinished():
            assert len(plans) < max_steps, "did not finish"
            plans.append(self.step())
        return plans


def fed(plan: StepPlan) -> list[tuple[str, int, int]]:
    """Each row as (request, start, length)."""
    return [(chunk.seq_id.request_id, chunk.start, len(chunk.token_ids)) for chunk in plan.chunks]


def admitted(plan: StepPlan) -> list[str]:
    """Requests whose first chunk is in ``plan``."""
    return [chunk.seq_id.request_id for chunk in plan.chunks if chunk.start == 0]


def test_decode_rows_come_before_prefill_chunks() -> None:
    harness = Harness()
    harness.add("a", prompt_len=3)
    harness.step()
    harness.add("b", prompt_len=5)
    plan = harness.step()
    assert fed(plan) == [("a", 3, 1), ("b", 0, 5)]
    assert [chunk.is_decode for chunk in plan.chunks] == [True, False]


@pytest.mark.parametrize(
    ("budget", "grid", "chunks"),
    [
        (16, None, [(0, 10)]),
        (4, None, [(0, 4), (4, 4), (8, 2)]),
        (16, 4, [(0, 4), (4, 4), (8, 2)]),
        (3, 4, [(0, 3), (3, 1), (4, 3), (7, 1), (8, 2)]),
    ],
    ids=["whole-prompt", "budget-splits", "grid-splits", "budget-and-grid"],
)
def test_long_prompt_prefills_in_chunks(budget: int, grid: int | None, chunks: list[tuple[int, int]]) -> None:
    harness = Harness(max_batch_tokens=budget, max_seqs=1, checkpoint_grid=grid)
    harness.add("a", prompt_len=10)
    plans = [harness.step() for _ in chunks]
    assert [(start, length) for plan in plans for _, start, length in fed(plan)] == chunks
    assert [len(plan.samples) for plan in plans] == [0] * (len(chunks) - 1) + [1]


def test_budget_is_shared_in_rank_order() -> None:
    harness = Harness(max_batch_tokens=6)
    harness.add("a", prompt_len=4)
    harness.add("b", prompt_len=4)
    assert fed(harness.step()) == [("a", 0, 4), ("b", 0, 2)]
    assert fed(harness.step()) == [("a", 4, 1), ("b", 2, 2)]


def test_interactive_is_admitted_before_batch_and_fcfs_within_a_priority() -> None:
    harness = Harness(max_seqs=1, max_batch_tokens=4)
    harness.add("b1", prompt_len=2, max_tokens=1, priority=BATCH)
    harness.add("i1", prompt_len=2, max_tokens=1)
    harness.add("b2", prompt_len=2, max_tokens=1, priority=BATCH)
    harness.add("i2", prompt_len=2, max_tokens=1)
    order = [fed(plan)[0][0] for plan in harness.run_to_end()]
    assert order == ["i1", "i2", "b1", "b2"]


def test_admission_keeps_the_watermark_free() -> None:
    # 10 blocks of 2 tokens, 2 kept free: a takes 3 and b 4, leaving 3; c's 2 would leave 1.
    harness = Harness(num_blocks=10, block_size=2, watermark=2, max_model_len=16)
    harness.add("a", prompt_len=6)
    harness.add("b", prompt_len=8)
    harness.add("c", prompt_len=4)
    assert [name for name, _, _ in fed(harness.step())] == ["a", "b"]
    assert harness.scheduler.stats().waiting == 1


def test_prompt_longer_than_max_model_len_is_rejected_at_add() -> None:
    harness = Harness(max_model_len=8)
    with pytest.raises(PromptTooLongError, match="9 tokens; the limit is 8"):
        harness.add("a", prompt_len=9)
    assert not harness.scheduler.has_unfinished()


def test_prompt_of_max_model_len_gets_one_token() -> None:
    harness = Harness(max_model_len=8)
    harness.add("a", prompt_len=8, max_tokens=5)
    harness.run_to_end()
    assert len(harness.emitted[SequenceId("a", 0)]) == 1
    assert harness.finished[SequenceId("a", 0)] is FinishReason.LENGTH


def crowded(swap_space_bytes: int, b_priority: Priority) -> Harness:
    """Three 2-token prompts in 4 blocks of 2: after one token each, only two of them fit."""
    harness = Harness(num_blocks=4, block_size=2, max_model_len=8, swap_space_bytes=swap_space_bytes)
    harness.add("a", prompt_len=2)
    harness.add("b", prompt_len=2, priority=b_priority)
    harness.add("c", prompt_len=2)
    harness.step()
    return harness


@pytest.mark.parametrize(
    ("b_priority", "victim"), [(BATCH, "b"), (INTERACTIVE, "c")], ids=["batch-first", "latest-arrival-first"]
)
def test_victim_is_lowest_priority_then_latest_arrival(b_priority: Priority, victim: str) -> None:
    harness = crowded(swap_space_bytes=0, b_priority=b_priority)
    plan = harness.step()
    assert plan.restarts == [SequenceId(victim, 0)]
    assert victim not in [name for name, _, _ in fed(plan)]


def test_only_the_lowest_ranked_sequence_gives_way() -> None:
    # a's 2-token prompt fills its block; b, c and d have room left in theirs. Only a must grow.
    harness = Harness(num_blocks=4, block_size=2, max_model_len=8)
    harness.add("a", prompt_len=2)
    for name in "bcd":
        harness.add(name, prompt_len=1)
    harness.step()
    plan = harness.step()
    assert plan.restarts == [SequenceId("d", 0)]
    assert [name for name, _, _ in fed(plan)] == ["a", "b", "c"]


def test_victim_swaps_out_when_swap_space_has_room() -> None:
    harness = crowded(swap_space_bytes=state_nbytes(2), b_priority=BATCH)
    plan = harness.step()
    assert [(s.seq_id, s.length) for s in plan.swap_outs] == [(SequenceId("b", 0), 2)]
    assert plan.restarts == []
    assert harness.scheduler.stats().swap_bytes_used == state_nbytes(2)


def test_victim_restarts_when_swap_space_is_full() -> None:
    harness = crowded(swap_space_bytes=state_nbytes(2) - 1, b_priority=BATCH)
    plan = harness.step()
    assert plan.swap_outs == [] and plan.restarts == [SequenceId("b", 0)]


@pytest.mark.parametrize("swap_space_bytes", [0, 10_000], ids=["restart", "swap"])
def test_preempted_sequence_continues_exactly(swap_space_bytes: int) -> None:
    harness = crowded(swap_space_bytes=swap_space_bytes, b_priority=BATCH)
    plans = harness.run_to_end()
    assert any(plan.preempted for plan in plans)
    for name in "abc":
        prompt = [len(name), 1]
        expected = isolated_tokens(prompt, 0, StopParams(max_tokens=4), harness.config.max_model_len)
        assert harness.emitted[SequenceId(name, 0)] == expected


def test_restart_prefills_prompt_and_outputs_without_emitting_them_again() -> None:
    harness = crowded(swap_space_bytes=0, b_priority=BATCH)
    harness.step()  # b restarts holding one output token
    b_chunks = [c for plan in harness.run_to_end() for c in plan.chunks if c.seq_id.request_id == "b"]
    assert (b_chunks[0].start, len(b_chunks[0].token_ids)) == (0, 3)  # prompt (2) + its one output
    assert len(harness.emitted[SequenceId("b", 0)]) == 4


def test_swapped_sequences_return_before_new_admissions_of_their_priority() -> None:
    harness = crowded(swap_space_bytes=10_000, b_priority=BATCH)
    harness.step()  # b swapped out
    harness.add("d", prompt_len=2, priority=BATCH)
    plan = harness.step()
    while "d" not in admitted(plan):
        assert harness.scheduler.stats().swapped > 0
        plan = harness.step()
    assert harness.scheduler.stats().swapped == 0
    assert SequenceId("b", 0) in [swap_in.seq_id for swap_in in plan.swap_ins]


def test_a_waiting_interactive_request_goes_before_a_swapped_batch_sequence() -> None:
    harness = crowded(swap_space_bytes=10_000, b_priority=BATCH)
    harness.step()  # b swapped out
    harness.add("d", prompt_len=2)
    b = SequenceId("b", 0)
    plan = harness.step()
    while "d" not in admitted(plan):
        assert b not in [s.seq_id for s in plan.swap_ins], "a batch sequence came back while an interactive waited"
        plan = harness.step()
    assert b not in [s.seq_id for s in plan.swap_ins]
    plans = harness.run_to_end()
    assert len(harness.emitted[SequenceId("b", 0)]) == 4 and any(p.swap_ins for p in plans)


def test_batch_is_never_admitted_while_interactive_waits() -> None:
    harness = Harness(max_seqs=2, max_batch_tokens=8)
    harness.add("i0", prompt_len=2, max_tokens=3)
    harness.add("i1", prompt_len=2, max_tokens=3)
    harness.add("b0", prompt_len=2, max_tokens=1, priority=BATCH)
    harness.add("i2", prompt_len=2, max_tokens=1)
    started: list[str] = []
    while harness.scheduler.has_unfinished():
        started += [name for name in admitted(harness.step()) if name not in started]
    assert started == ["i0", "i1", "i2", "b0"]


def test_n_choices_prefill_once_and_fork_into_free_slots() -> None:
    harness = Harness()
    harness.add("a", prompt_len=5, n=3)
    plan = harness.step()
    assert fed(plan) == [("a", 0, 5)]
    assert [(f.child, f.length) for f in plan.forks] == [(SequenceId("a", 1), 5), (SequenceId("a", 2), 5)]
    assert all(f.child_slot is not None for f in plan.forks)
    assert [(s.seq_id.choice, s.row, s.position) for s in plan.samples] == [(0, 0, 5), (1, 0, 5), (2, 0, 5)]
    assert fed(harness.step()) == [("a", 5, 1)] * 3


@pytest.mark.parametrize(
    ("swap_space_bytes", "parked"), [(10_000, True), (0, False)], ids=["fork-to-host", "fork-restarts"]
)
def test_fork_without_a_free_slot(swap_space_bytes: int, parked: bool) -> None:
    harness = Harness(num_slots=1, max_seqs=1, swap_space_bytes=swap_space_bytes)
    harness.add("a", prompt_len=3, n=2)
    plan = harness.step()
    assert [(f.child, f.child_slot) for f in plan.forks] == ([(SequenceId("a", 1), None)] if parked else [])
    later = harness.run_to_end()
    child_chunks = [c for p in later for c in p.chunks if c.seq_id == SequenceId("a", 1)]
    assert child_chunks[0].start == (3 if parked else 0)
    assert any(p.swap_ins for p in later) is parked
    for choice in range(2):
        expected = isolated_tokens([1, 1, 2], choice, StopParams(max_tokens=4), harness.config.max_model_len)
        assert harness.emitted[SequenceId("a", choice)] == expected


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_frees_everything_the_request_holds(where: str) -> None:
    harness = crowded(swap_space_bytes=10_000, b_priority=BATCH)
    harness.step()  # b swapped out, a and c running
    harness.add("w", prompt_len=2)  # waits behind the swapped b
    name = {"waiting": "w", "running": "a", "swapped": "b"}[where]
    assert harness.scheduler.abort(name) == [SequenceId(name, 0)]
    assert harness.scheduler.is_finished(name)
    harness.run_to_end()
    stats = harness.scheduler.stats()
    assert (stats.free_slots, stats.free_blocks, stats.swap_bytes_used) == (4, 4, 0)
    assert SequenceId(name, 0) not in harness.finished


def test_abort_of_an_unknown_request_is_harmless() -> None:
    assert Harness().scheduler.abort("nobody") == []


def test_duplicate_request_ids_are_refused() -> None:
    harness = Harness()
    harness.add("a", prompt_len=2)
    with pytest.raises(ValueError, match="already scheduled"):
        harness.add("a", prompt_len=2)


def test_postprocess_needs_one_token_per_sample() -> None:
    harness = Harness()
    harness.add("a", prompt_len=2)
    plan = harness.scheduler.schedule()
    with pytest.raises(ValueError, match="0 sampled tokens for 1"):
        harness.scheduler.postprocess(plan, [])


@pytest.mark.parametrize("swap_space_bytes", [10_000, 0], ids=["swapped", "restarted"])
def test_an_interactive_request_takes_the_slot_of_the_latest_batch_sequence(swap_space_bytes: int) -> None:
    harness = Harness(max_seqs=2, swap_space_bytes=swap_space_bytes)
    harness.add("b0", prompt_len=2, max_tokens=8, priority=BATCH)
    harness.add("b1", prompt_len=2, max_tokens=8, priority=BATCH)
    harness.step()
    harness.step()  # both batch sequences decode, every slot taken
    harness.add("i", prompt_len=2, max_tokens=2)
    plan = harness.step()
    victim = SequenceId("b1", 0)
    preempted = [s.seq_id for s in plan.swap_outs] if swap_space_bytes else plan.restarts
    assert preempted == [victim] and "b1" not in [name for name, *_ in fed(plan)]
    assert "i" in admitted(plan)  # into the slot b1 left, in the same step
    harness.run_to_end()
    assert harness.emitted[SequenceId("i", 0)] == isolated_tokens([1, 1], 0, StopParams(2), 32)
    for name in ("b0", "b1"):  # the preempted one continues exactly
        assert harness.emitted[SequenceId(name, 0)] == isolated_tokens([2, 1], 0, StopParams(8), 32)


def test_no_interactive_request_preempts_another_interactive_one() -> None:
    harness = Harness(max_seqs=1)
    harness.add("i0", prompt_len=2, max_tokens=4)
    harness.step()
    harness.add("i1", prompt_len=2, max_tokens=4)
    plans = harness.run_to_end()
    assert not any(p.swap_outs or p.restarts for p in plans)


def test_batch_decode_rows_sit_out_the_steps_that_prefill_an_interactive_prompt() -> None:
    harness = Harness(max_seqs=3, max_batch_tokens=4)
    harness.add("b0", prompt_len=2, max_tokens=8, priority=BATCH)
    harness.step()
    harness.add("i", prompt_len=6, max_tokens=2)  # prefilled in two chunks of the budget
    rows = [fed(harness.step()) for _ in range(3)]
    assert rows[0] == [("i", 0, 4)] and rows[1] == [("i", 4, 2)]  # b0 waits while i's prompt goes in
    assert sorted(name for name, *_ in rows[2]) == ["b0", "i"]  # then both decode
    harness.run_to_end()
    assert harness.emitted[SequenceId("b0", 0)] == isolated_tokens([2, 1], 0, StopParams(8), 32)
