"""Speculative decoding on the recording fake: over the exactness suite's random schedules (arrivals,
chunked prefill, both kinds of preemption, aborts, ``n`` up to 3, stop tokens kept or withheld, greedy
and seeded sampling with temperature, top-k/p, min-p, penalties and logit bias, requests continuing
tokens generated elsewhere or resumed from a checkpoint, some constrained by a grammar), every choice's
tokens, logprobs and finish equal plain decoding's, whatever share of the draft is wrong; the fake sees
no feed of an unsettled or corrupted state and no chunk that starts anywhere but where its slot's state
stands (no position consumed twice)."""

from __future__ import annotations

import functools
import hashlib
import re
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metrale.worker.engine.constraints import GrammarCompiler
from metrale.worker.engine.draft_length import DraftLengthPolicy, FullDraftLengths
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.ngram_draft import ngram_draft
from metrale.worker.engine.request import RequestOutput
from metrale.worker.engine.runner import accept_draft
from metrale.worker.engine.sampler import SampledToken
from metrale.worker.engine.speculation import Drafter, SpeculationStats, SpeculationTally, SpeculativeConfig
from metrale.worker.engine.state_ledger import StateInvariantError, StateLedger
from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.sequence import FinishReason, Priority, SequenceId
from tests.worker.engine.test_engine import (
    EOS,
    _crowded,
    arrival_of,
    check_choice,
    drive,
    emitted_run,
    expected_run,
)
from tests.worker.fakes import FAKE_TEXT, VOCAB_SIZE, RecordingModel, fake_tokenizer, isolated_run
from tests.worker.scheduler.strategies import GRAMMARS, TOKEN_RANGE, RequestSpec, Scenario, scenarios


class OracleDrafter:
    """Drafts each choice's own plain-decoding continuation (known in advance here), with about
    ``wrong_share`` of the draft tokens replaced by another token: sets the acceptance at will."""

    def __init__(self, expected: dict[SequenceId, list[int]], wrong_share: float, k: int) -> None:
        self.expected, self.wrong_share, self.k = expected, wrong_share, k
        self.num_speculative_tokens = k
        self.proposed = 0
        self.forgotten: list[str] = []

    def propose(
        self, seq_id: SequenceId, prompt_ids: Sequence[int], output_ids: Sequence[int], at_most: int
    ) -> Sequence[int]:
        continuation = self.expected[seq_id][len(output_ids) : len(output_ids) + min(self.k, at_most)]
        draft = [self._maybe_wrong(seq_id, len(output_ids) + i, t) for i, t in enumerate(continuation)]
        self.proposed += len(draft)
        return draft

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)

    def _maybe_wrong(self, seq_id: SequenceId, position: int, token: int) -> int:
        digest = hashlib.blake2b(f"{seq_id}:{position}".encode(), digest_size=2).digest()
        wrong = int.from_bytes(digest, "little") / 2**16 < self.wrong_share
        return (token + 1) % TOKEN_RANGE if wrong else token


def _run(
    scenario: Scenario, drafter: Drafter | None, lengths: DraftLengthPolicy | None = None
) -> tuple[dict, set[str], RecordingModel, Engine]:
    ledger = StateLedger()
    model = RecordingModel(scenario.config.num_slots, scenario.config.num_blocks, scenario.config.block_size)
    engine = Engine(
        model,
        scenario.config,
        eos_token_ids=[EOS],
        seed=0,
        ledger=ledger,
        drafter=drafter,
        draft_lengths=lengths,
        grammars=_fake_grammars(),
    )
    outputs, aborted = drive(engine, model, scenario)
    stats = engine.stats()
    assert (stats.free_slots, stats.free_blocks) == (scenario.config.num_slots, scenario.config.num_blocks)
    assert stats.swap_bytes_used == 0 and ledger.is_empty
    assert all(record.owner is not None for forward in model.forwards for record in forward)
    assert model.misplaced_feeds == []
    return outputs, aborted, model, engine


@functools.cache
def _fake_grammars() -> GrammarCompiler:
    return GrammarCompiler(fake_tokenizer(), VOCAB_SIZE)


def _arrivals() -> Scenario:
    """A request continuing 3 tokens generated elsewhere, one resumed from the state after 2 prompt tokens and
    one constrained by a grammar, each sampled with a filter or penalty."""
    config = SchedulerConfig(
        max_batch_tokens=12, max_seqs=3, num_slots=3, num_blocks=24, block_size=2, max_model_len=16
    )
    penalized = (("presence_penalty", 0.8), ("logit_bias", ((3, 3.0),)))
    filtered = (("temperature", 0.5), ("top_k", 4), ("logit_bias", ()))
    first = Priority.INTERACTIVE
    requests = (
        RequestSpec("r0", (0, 5, 6), 8, 1, first, (), False, True, True, 1, 0, None, penalized, continued=3),
        RequestSpec("r1", (1, 7, 2, 9), 8, 1, first, (), False, False, True, 2, 0, None, filtered, checkpoint_at=2),
        RequestSpec("r2", (2, 4), 8, 1, first, (), True, False, False, 3, 1, None, filtered, grammar=min(GRAMMARS)),
    )
    return Scenario(config, requests)


def test_random_schedules_with_speculation_equal_plain_decoding() -> None:
    seen: Counter[str] = Counter()

    @example(_arrivals(), 0.3, 4)
    @example(_crowded(swap_space_bytes=0), 0.0, 4)
    @example(_crowded(swap_space_bytes=100_000), 0.3, 3)
    @settings(max_examples=40, deadline=None)
    @given(scenarios(constrained=True), st.sampled_from([0.0, 0.3, 0.6, 1.0]), st.integers(1, 5))
    def check(scenario: Scenario, wrong_share: float, k: int) -> None:
        expected = {}
        for spec in scenario.requests:
            for choice in range(spec.n):
                tokens, _ = expected_run(spec, choice, scenario.config.max_model_len)
                expected[SequenceId(spec.request_id, choice)] = tokens
        plain, plain_aborted, _, _ = _run(scenario, None)
        _check_against_plain(scenario, plain, plain_aborted, _run(scenario, OracleDrafter(expected, wrong_share, k)))
        drafter = OracleDrafter(expected, wrong_share, k)
        spec_outputs, aborted, model, engine = _run(scenario, drafter, FullDraftLengths())
        sentences = _check_against_plain(scenario, plain, plain_aborted, (spec_outputs, aborted, model, engine))
        assert model.settled_rows <= model.verify_rows
        seen["verified"] += model.verify_rows > 0
        seen["accepted a draft token"] += model.settled_rows > model.verify_chunks
        seen["preempted"] += engine.stats().swap_outs + engine.stats().restarts > 0
        seen["sampled with a filter or penalty"] += any(
            not spec.greedy and len(spec.sampling) > 1 for spec in scenario.requests
        )
        arrivals = [arrival_of(spec, scenario.config.max_model_len) for spec in scenario.requests]
        seen["continued"] += any(generated for generated, _ in arrivals)
        seen["resumed"] += any(resume is not None for _, resume in arrivals)
        seen["constrained"] += any(spec.grammar is not None for spec in scenario.requests)
        seen["constrained choice ended a sentence"] += sentences > 0

    check()
    assert seen["verified"] > 10 and seen["accepted a draft token"] > 10 and seen["preempted"] > 0, seen
    assert seen["sampled with a filter or penalty"] > 5 and seen["continued"] > 1 and seen["resumed"] > 1, seen
    assert seen["constrained"] > 5 and seen["constrained choice ended a sentence"] > 1, seen


def _check_against_plain(
    scenario: Scenario, plain: dict, plain_aborted: set[str], run: tuple[dict, set[str], RecordingModel, Engine]
) -> int:
    """Every choice's tokens, finish, logprobs and alternatives in ``run`` are plain decoding's; returns how
    many constrained choices ended on a stop token with a sentence of their grammar."""
    spec_outputs, aborted, _, _ = run
    sentences = 0
    for spec in scenario.requests:
        for choice in range(spec.n):
            seq_id = SequenceId(spec.request_id, choice)
            got = spec_outputs.get(seq_id, [])
            if spec.grammar is None:
                reference, reason = emitted_run(spec, choice, scenario.config.max_model_len)
                check_choice(got, reference, reason, spec.request_id in aborted)
            else:  # constrained: plain decoding's own run is the reference
                _check_constrained(got, plain.get(seq_id, []), spec.request_id in aborted | plain_aborted)
                sentences += _check_grammar(got, spec)
            # logprobs and alternatives are plain decoding's, token for token
            plain_logprobs = [
                (lp, top) for o in plain.get(seq_id, []) for lp, top in zip(o.logprobs, o.top_logprobs, strict=True)
            ]
            spec_logprobs = [(lp, top) for o in got for lp, top in zip(o.logprobs, o.top_logprobs, strict=True)]
            common = min(len(plain_logprobs), len(spec_logprobs))
            assert spec_logprobs[:common] == plain_logprobs[:common]
            if spec.request_id not in aborted | plain_aborted:
                assert common == len(plain_logprobs) == len(spec_logprobs)
    return sentences


def _check_constrained(got: list[RequestOutput], plain: list[RequestOutput], aborted: bool) -> None:
    """A constrained choice's tokens and finish are plain decoding's (a prefix of them where either run
    was aborted)."""
    tokens = [t for o in got for t in o.token_ids]
    plain_tokens = [t for o in plain for t in o.token_ids]
    common = min(len(tokens), len(plain_tokens))
    assert tokens[:common] == plain_tokens[:common]
    if not aborted:
        assert tokens == plain_tokens
        assert [(o.finish_reason, o.error) for o in got if o.finished] == [
            (o.finish_reason, o.error) for o in plain if o.finished
        ]


def _check_grammar(got: list[RequestOutput], spec: RequestSpec) -> bool:
    """A constrained choice that stopped on a stop token (not refused, not cut short) spells a sentence of
    its grammar before that token; True when it did stop so."""
    assert spec.grammar is not None
    if not got or got[-1].finish_reason is not FinishReason.STOP:
        return False
    tokens = [t for o in got for t in o.token_ids]
    if spec.include_stop_token:
        tokens = tokens[:-1]
    assert re.fullmatch(GRAMMARS[spec.grammar], "".join(FAKE_TEXT[t] for t in tokens)), tokens
    return True


def test_the_fake_lists_a_chunk_that_feeds_a_position_again_or_skips_one() -> None:
    from metrale.worker.model.interface import ForwardChunk

    model = RecordingModel(num_slots=1, num_blocks=4, block_size=4)
    model.forward([ForwardChunk(0, [0, 1], 0, [1, 2, 3])])
    model.forward([ForwardChunk(0, [0, 1], 3, [4])])  # where the state stands
    model.forward([ForwardChunk(0, [0, 1], 3, [5])])  # position 3 again
    model.forward([ForwardChunk(0, [0, 1], 0, [1])])  # a fresh state
    model.forward([ForwardChunk(0, [0, 1], 2, [6])])  # position 1 skipped
    assert [(record.start, record.length) for record in model.misplaced_feeds] == [(3, 1), (2, 1)]


def test_accept_draft_takes_the_draft_up_to_its_first_miss_then_the_drawn_token() -> None:
    drawn = [SampledToken(t, -0.5, ()) for t in (4, 5, 9, 7)]
    assert [t.token_id for t in accept_draft([4, 5, 6], drawn)] == [4, 5, 9]
    assert [t.token_id for t in accept_draft([4, 5, 9], drawn)] == [4, 5, 9, 7]
    assert [t.token_id for t in accept_draft([1, 5, 9], drawn)] == [4]
    assert [t.token_id for t in accept_draft([], drawn[:1])] == [4]


def test_ngram_draft_continues_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert ngram_draft(tokens, 2, longest=3, shortest=1) == (4, 9)  # [1, 2, 3] matched at 0
    assert ngram_draft(tokens, 2, longest=2, shortest=1) == (5, 6)  # [2, 3] latest at 5
    assert ngram_draft([1, 2, 3, 7], 4, longest=3, shortest=1) == ()
    assert ngram_draft([5, 5], 3, longest=3, shortest=1) == (5,)
    assert ngram_draft(tokens, 0, longest=3, shortest=1) == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 4}', "not served"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "model": "x"}', "model is the draft_model method's"),
        ('{"method": "draft_model", "num_speculative_tokens": 4}', "draft_model method needs a model"),
        ('{"model": "x", "prompt_lookup_max": 2}', "prompt_lookup_max: the ngram method's"),
        ('{"model": 3}', "model must be a string"),
        ('{"num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}', "unknown speculative-config keys"),
        ('{"num_speculative_tokens": 4}', "needs a method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
        ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "1 <= min <= max"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ],
)
def test_speculative_config_refuses_what_it_does_not_serve(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


def test_speculative_config_reads_vllm_keys() -> None:
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}'
    )
    assert config == SpeculativeConfig("ngram", 3, 5, 2)
    draft = SpeculativeConfig.from_json('{"model": "/models/draft", "num_speculative_tokens": 3}')
    assert draft == SpeculativeConfig("draft_model", 3, model="/models/draft"), "a model implies draft_model"
    assert SpeculativeConfig.from_json('{"method": "draft_model", "model": "d"}').model == "d"


def test_the_ledger_refuses_to_touch_an_unsettled_slot() -> None:
    from metrale.worker.engine.state_ledger import FedChunk

    ledger, owner = StateLedger(), SequenceId("r", 0)
    ledger.feed([FedChunk(owner, 0, 0, 5)])
    ledger.feed([FedChunk(owner, 0, 5, 4, verify=True)])
    with pytest.raises(StateInvariantError, match="unsettled"):
        ledger.feed([FedChunk(owner, 0, 9, 1)])
    with pytest.raises(StateInvariantError, match="keeps 5 rows"):
        ledger.settle(owner, 0, 5)
    ledger.settle(owner, 0, 2)
    with pytest.raises(StateInvariantError, match="expects slot 0 at position 9"):
        ledger.feed([FedChunk(owner, 0, 9, 1)])
    ledger.feed([FedChunk(owner, 0, 7, 1)])


def test_snapshots_with_speculation_are_those_without_it() -> None:
    """Decode checkpoints every 3 outputs and the final state: the same positions and states, though a
    verify step may emit several tokens (it never verifies past the next checkpoint)."""
    from metrale.worker.engine.request import Request
    from metrale.worker.engine.sampling_params import SamplingParams
    from metrale.worker.scheduler.config import SchedulerConfig

    config = SchedulerConfig(
        max_batch_tokens=16, max_seqs=2, num_slots=2, num_blocks=16, block_size=4, max_model_len=40
    )
    prompts = [(1, 2, 3, 4, 5), (2, 7, 7)]
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True), SamplingParams(max_tokens=11, seed=4)]
    expected = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        stops = frozenset() if p.ignore_eos else frozenset({EOS})
        expected[SequenceId(f"s{i}", 0)] = isolated_run(prompt, p, p.seed or 0, 0, stops, config.max_model_len)[0]

    def snapshots(drafter: Drafter | None) -> list[tuple[str, tuple[int, ...], bool, bool, list[int]]]:
        model = RecordingModel(config.num_slots, config.num_blocks, config.block_size)
        engine = Engine(model, config, eos_token_ids=[EOS], seed=0, decode_checkpoint_interval=3, drafter=drafter)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(Request(f"s{i}", prompt, p, snapshots=True))
        taken = []
        while engine.has_unfinished():
            engine.step()
            taken += engine.take_snapshots()
        return sorted((s.request_id, s.consumed, s.final, s.decode, s.state["tokens"].tolist()) for s in taken)

    plain = snapshots(None)
    assert sum(1 for s in plain if s[3]) >= 4  # decode checkpoints were taken
    for drafter in (OracleDrafter(expected, 0.0, 4), OracleDrafter(expected, 0.5, 2)):
        assert snapshots(drafter) == plain
        assert drafter.proposed > 0


def _two_requests_run(drafter: Drafter | None, speculative: tuple[bool, bool]) -> tuple[dict[str, list[int]], Engine]:
    """Two greedy requests on the recording fake, run to the end; each request's tokens by id."""
    from metrale.worker.engine.request import Request
    from metrale.worker.engine.sampling_params import SamplingParams
    from metrale.worker.scheduler.config import SchedulerConfig

    config = SchedulerConfig(
        max_batch_tokens=32, max_seqs=2, num_slots=2, num_blocks=32, block_size=4, max_model_len=60
    )
    model = RecordingModel(config.num_slots, config.num_blocks, config.block_size)
    engine = Engine(model, config, eos_token_ids=[EOS], seed=0, drafter=drafter)
    for i, wants in enumerate(speculative):
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=wants)
        engine.add_request(Request(f"s{i}", (1 + i, 2, 3), params))
    tokens: dict[str, list[int]] = {"s0": [], "s1": []}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
    return tokens, engine


def _greedy_continuations() -> dict[SequenceId, list[int]]:
    from metrale.worker.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    return {SequenceId(f"s{i}", 0): isolated_run((1 + i, 2, 3), params, 0, 0, frozenset(), 60)[0] for i in range(2)}


def test_speculation_stats_count_drafts_and_accepted_positions() -> None:
    """A draft whose second token is always wrong: every chunk accepts exactly its first token."""

    class SecondWrong(OracleDrafter):
        def propose(
            self, seq_id: SequenceId, prompt_ids: Sequence[int], output_ids: Sequence[int], at_most: int
        ) -> Sequence[int]:
            draft = list(super().propose(seq_id, prompt_ids, output_ids, at_most))
            if len(draft) >= 2:
                draft[1] = (draft[1] + 1) % TOKEN_RANGE
            return draft

    expected = _greedy_continuations()
    plain, plain_engine = _two_requests_run(None, (True, True))
    assert plain_engine.speculation_stats() == SpeculationStats()
    drafter = SecondWrong(expected, 0.0, 3)
    tokens, engine = _two_requests_run(drafter, (True, True))
    assert tokens == plain
    stats = engine.speculation_stats()
    assert stats.drafts > 0 and stats.draft_tokens == drafter.proposed
    long_drafts = stats.accepted_per_position[1] if len(stats.accepted_per_position) > 1 else 0
    assert long_drafts == 0 and stats.accepted_per_position[0] == stats.accepted_tokens
    assert 0 < stats.acceptance_rate < 1


def test_a_request_that_turns_speculation_off_is_never_drafted() -> None:
    drafted: list[SequenceId] = []

    class Recording(OracleDrafter):
        def propose(
            self, seq_id: SequenceId, prompt_ids: Sequence[int], output_ids: Sequence[int], at_most: int
        ) -> Sequence[int]:
            drafted.append(seq_id)
            return super().propose(seq_id, prompt_ids, output_ids, at_most)

    expected = _greedy_continuations()
    plain, _ = _two_requests_run(None, (True, True))
    drafter = Recording(expected, 0.0, 4)
    tokens, engine = _two_requests_run(drafter, (False, True))
    assert tokens == plain
    assert drafted and {seq_id.request_id for seq_id in drafted} == {"s1"}
    assert engine.speculation_stats().accepted_tokens > 0
    assert sorted(drafter.forgotten) == ["s0", "s1"], "the drafter is told when each request is done"


def test_speculation_tally_keeps_one_count_per_draft_position() -> None:
    tally = SpeculationTally()
    tally.record(0, 0)  # a plain decode row: not a draft
    tally.record(2, 2)
    tally.record(4, 1)
    assert tally.stats() == SpeculationStats(2, 6, 3, (2, 1, 0, 0))
    with pytest.raises(ValueError, match="3 draft tokens accepted of 2"):
        tally.record(2, 3)


def test_sampling_params_speculative_is_a_bool() -> None:
    from metrale.worker.engine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="speculative must be a bool"):
        SamplingParams(speculative=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("wrong_share", "adaptive_share"), [(1.0, 0.1), (0.0, 1.0)])
def test_the_adaptive_draft_length_backs_off_only_drafts_that_miss(wrong_share: float, adaptive_share: float) -> None:
    """One greedy request of 120 tokens: with every draft token wrong, the adaptive length verifies under
    a tenth of the draft tokens the full length does; with every one right, as many; the tokens are
    plain decoding's either way."""
    from metrale.worker.engine.request import Request
    from metrale.worker.engine.sampling_params import SamplingParams
    from metrale.worker.scheduler.config import SchedulerConfig

    config = SchedulerConfig(
        max_batch_tokens=16, max_seqs=1, num_slots=1, num_blocks=40, block_size=4, max_model_len=160
    )
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    prompt = (3, 1, 4, 1, 5)
    expected = {SequenceId("r", 0): isolated_run(prompt, params, 0, 0, frozenset(), config.max_model_len)[0]}

    def run(lengths: DraftLengthPolicy | None) -> tuple[list[int], SpeculationStats]:
        model = RecordingModel(config.num_slots, config.num_blocks, config.block_size)
        drafter = OracleDrafter(expected, wrong_share, 4)
        engine = Engine(model, config, seed=0, drafter=drafter, draft_lengths=lengths)
        engine.add_request(Request("r", prompt, params))
        tokens: list[int] = []
        while engine.has_unfinished():
            tokens += [t for output in engine.step() for t in output.token_ids]
        return tokens, engine.speculation_stats()

    adaptive, adaptive_stats = run(None)
    full, full_stats = run(FullDraftLengths())
    assert adaptive == full == expected[SequenceId("r", 0)]
    assert full_stats.draft_tokens > 90
    assert adaptive_stats.draft_tokens <= adaptive_share * full_stats.draft_tokens
    if adaptive_share == 1.0:
        assert adaptive_stats == full_stats


def test_draft_lengths_without_a_drafter_are_refused() -> None:
    from metrale.worker.scheduler.config import SchedulerConfig

    config = SchedulerConfig(max_batch_tokens=16, max_seqs=1, num_slots=1, num_blocks=8, block_size=4, max_model_len=32)
    model = RecordingModel(config.num_slots, config.num_blocks, config.block_size)
    with pytest.raises(ValueError, match="draft_lengths without a drafter"):
        Engine(model, config, draft_lengths=FullDraftLengths())
