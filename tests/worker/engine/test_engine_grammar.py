"""Grammar-constrained requests on the real tiny model: every output is valid JSON for its schema, and
the constraint is exact state: preemption, n=2 forks, a checkpoint resume, a continuation from emitted
tokens and a suspended request all give the tokens of an undisturbed run."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from metrale.text.grammars import json_schema_grammar
from metrale.text.tokenizer import Tokenizer
from metrale.worker.engine.constraints import GrammarCompiler
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Completion, Request, ResumePoint
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.snapshots import Snapshot
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.sequence import FinishReason

BLOCK = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "lamp"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA)
MAX_TOKENS = 80  # the longest sentence of SCHEMA is far shorter, whatever the tokens
PROMPTS = [tuple(range(40 + 7 * i, 40 + 7 * i + 9 + 3 * i)) for i in range(6)]
PARAMS = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=GRAMMAR),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, grammar=GRAMMAR),
    "seeded-filtered-penalized": SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, top_k=50, seed=5, frequency_penalty=0.7, grammar=GRAMMAR
    ),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def executor(tiny_model_dir: Path) -> ModelExecutor:
    return ModelExecutor(load_model(tiny_model_dir), num_slots=8, num_blocks=96, block_size=BLOCK)


def make_engine(
    executor: ModelExecutor,
    tokenizer: Tokenizer,
    *,
    blocks: int = 96,
    swap_bytes: int = 64 << 20,
    interval: int | None = None,
) -> Engine:
    config = SchedulerConfig(
        max_batch_tokens=128,
        max_seqs=8,
        num_slots=8,
        num_blocks=blocks,
        block_size=BLOCK,
        swap_space_bytes=swap_bytes,
        max_model_len=blocks * BLOCK,
    )
    compiler = GrammarCompiler(tokenizer, executor.vocab_size)
    return Engine(
        executor,
        config,
        eos_token_ids=tokenizer.eos_token_ids,
        seed=0,
        decode_checkpoint_interval=interval,
        grammars=compiler,
    )


def run(engine: Engine, requests: list[Request]) -> tuple[dict[tuple[str, int], Completion], list[Snapshot]]:
    for request in requests:
        engine.add_request(request)
    completions: dict[tuple[str, int], Completion] = {}
    snapshots: list[Snapshot] = []
    while engine.has_unfinished():
        for output in engine.step():
            completions.setdefault((output.request_id, output.choice), Completion()).extend(output)
        snapshots += engine.take_snapshots()
    return completions, snapshots


def assert_valid(tokenizer: Tokenizer, completion: Completion) -> None:
    assert completion.finish_reason is FinishReason.STOP
    assert completion.token_ids[-1] in tokenizer.eos_token_ids
    jsonschema.validate(json.loads(tokenizer.decode(completion.token_ids)), SCHEMA)


def requests_of(params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", prompt, params) for i, prompt in enumerate(PROMPTS)]


@pytest.fixture(scope="module", params=sorted(PARAMS))
def undisturbed(
    request: pytest.FixtureRequest, executor: ModelExecutor, tokenizer: Tokenizer
) -> tuple[SamplingParams, dict[tuple[str, int], Completion]]:
    params = PARAMS[request.param]
    engine = make_engine(executor, tokenizer)
    completions = {}
    for one in requests_of(params):  # one at a time: no batching, no preemption
        completions |= run(engine, [one])[0]
    for completion in completions.values():
        assert_valid(tokenizer, completion)
    return params, completions


def test_preempted_constrained_requests_give_the_undisturbed_tokens(
    executor: ModelExecutor, tokenizer: Tokenizer, undisturbed: tuple[SamplingParams, dict[tuple[str, int], Completion]]
) -> None:
    params, whole = undisturbed
    # 12 blocks for six sequences of up to ~110 tokens, swap for about one state: both kinds of preemption.
    engine = make_engine(executor, tokenizer, blocks=12, swap_bytes=60_000)
    got, _ = run(engine, requests_of(params))
    stats = engine.stats()
    assert stats.swap_outs > 0 and stats.restarts > 0, stats
    assert {key: c.token_ids for key, c in got.items()} == {key: c.token_ids for key, c in whole.items()}


def test_n_2_forks_each_follow_the_grammar_and_choice_0_is_the_n_1_run(
    executor: ModelExecutor, tokenizer: Tokenizer, undisturbed: tuple[SamplingParams, dict[tuple[str, int], Completion]]
) -> None:
    params, whole = undisturbed
    forked = SamplingParams(**{**_fields(params), "n": 2})
    alone, _ = run(make_engine(executor, tokenizer), [Request("r0", PROMPTS[0], forked)])
    assert alone[("r0", 0)].token_ids == whole[("r0", 0)].token_ids
    for completion in alone.values():
        assert_valid(tokenizer, completion)
    crowded, _ = run(
        make_engine(executor, tokenizer, blocks=12, swap_bytes=60_000),
        [Request(f"r{i}", prompt, forked) for i, prompt in enumerate(PROMPTS)],
    )
    assert crowded[("r0", 1)].token_ids == alone[("r0", 1)].token_ids
    assert all(crowded[(f"r{i}", 0)].token_ids == whole[(f"r{i}", 0)].token_ids for i in range(len(PROMPTS)))


def test_every_decode_checkpoint_resumes_the_constrained_request_exactly(
    executor: ModelExecutor, tokenizer: Tokenizer, undisturbed: tuple[SamplingParams, dict[tuple[str, int], Completion]]
) -> None:
    params, whole = undisturbed
    expected = whole[("r1", 0)].token_ids
    _, snapshots = run(
        make_engine(executor, tokenizer, interval=4), [Request("r1", PROMPTS[1], params, snapshots=True)]
    )
    decode = [s for s in snapshots if s.decode and len(s.consumed) - len(PROMPTS[1]) < len(expected) - 1]
    assert len(decode) >= 3
    for snapshot in decode:
        emitted = len(snapshot.consumed) - len(PROMPTS[1]) + 1  # the worker died one token after it
        resume = ResumePoint(len(snapshot.consumed), snapshot.state)
        request = Request("r1", PROMPTS[1], params, generated=tuple(expected[:emitted]), resume=resume)
        rest, _ = run(make_engine(executor, tokenizer), [request])
        assert expected[:emitted] + rest[("r1", 0)].token_ids == expected, f"resumed after {emitted} tokens"


@pytest.mark.parametrize("emitted", [1, 5, 9])
def test_a_continuation_from_emitted_tokens_alone_replays_the_grammar(
    executor: ModelExecutor,
    tokenizer: Tokenizer,
    undisturbed: tuple[SamplingParams, dict[tuple[str, int], Completion]],
    emitted: int,
) -> None:
    params, whole = undisturbed
    expected = whole[("r2", 0)].token_ids
    engine = make_engine(executor, tokenizer)
    rest, _ = run(engine, [Request("r2", PROMPTS[2], params, generated=tuple(expected[:emitted]))])
    assert expected[:emitted] + rest[("r2", 0)].token_ids == expected


def test_a_suspended_constrained_request_continues_elsewhere(
    executor: ModelExecutor, tokenizer: Tokenizer, undisturbed: tuple[SamplingParams, dict[tuple[str, int], Completion]]
) -> None:
    params, whole = undisturbed
    expected = whole[("r3", 0)].token_ids
    first = make_engine(executor, tokenizer)
    first.add_request(Request("r3", PROMPTS[3], params))
    emitted = [token for _ in range(6) for output in first.step() for token in output.token_ids]
    snapshot = first.suspend("r3")
    assert snapshot is not None
    resume = ResumePoint(len(snapshot.consumed), snapshot.state)
    rest, _ = run(
        make_engine(executor, tokenizer), [Request("r3", PROMPTS[3], params, generated=tuple(emitted), resume=resume)]
    )
    assert emitted + rest[("r3", 0)].token_ids == expected


def test_a_grammar_that_does_not_compile_or_cannot_end_is_refused(
    executor: ModelExecutor, tokenizer: Tokenizer
) -> None:
    engine = make_engine(executor, tokenizer)
    with pytest.raises(ValueError, match="Unimplemented keys"):
        engine.add_request(Request("bad", PROMPTS[0], SamplingParams(grammar=json_schema_grammar({"not": {}}))))
    with pytest.raises(ValueError, match="needs a stop token"):
        engine.add_request(Request("endless", PROMPTS[0], SamplingParams(grammar=GRAMMAR, ignore_eos=True)))
    config = SchedulerConfig(
        max_batch_tokens=128, max_seqs=8, num_slots=8, num_blocks=96, block_size=BLOCK, max_model_len=96 * BLOCK
    )
    with pytest.raises(ValueError, match="without a grammar compiler"):
        Engine(executor, config).add_request(Request("x", PROMPTS[0], SamplingParams(grammar=GRAMMAR)))
    assert not engine.has_unfinished()


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__slots__}


ENDLESS = {
    "self-recursive": {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]},
    "ref-cycle": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "ref-cycle-in-a-property": {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}},
        "required": ["a"],
        "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}},
    },
}


@pytest.mark.parametrize("name", sorted(ENDLESS))
def test_a_grammar_at_a_dead_end_refuses_the_choice_instead_of_stopping(
    executor: ModelExecutor, tokenizer: Tokenizer, name: str
) -> None:
    """The backstop behind the gateway's static check: a schema no finite output satisfies ends each
    choice refused, with the reason, not ``stop`` with a broken output; a continuation from the
    emitted tokens reaches the same dead end (the constraint is rebuilt from them)."""
    params = SamplingParams(max_tokens=30, temperature=0.0, n=2, grammar=json_schema_grammar(ENDLESS[name]))
    completions, _ = run(make_engine(executor, tokenizer), [Request("endless", PROMPTS[0], params)])
    assert sorted(completions) == [("endless", 0), ("endless", 1)]
    for completion in completions.values():
        assert completion.finish_reason is FinishReason.REFUSED
        assert completion.error is not None and "dead end" in completion.error
        assert not set(completion.token_ids) & set(tokenizer.eos_token_ids)  # no stop token emitted
    emitted = completions[("endless", 0)].token_ids
    alone = SamplingParams(max_tokens=30, temperature=0.0, grammar=params.grammar)  # a continuation has one choice
    rest, _ = run(make_engine(executor, tokenizer), [Request("again", PROMPTS[0], alone, generated=tuple(emitted))])
    assert rest[("again", 0)].finish_reason is FinishReason.REFUSED
    if name != "self-recursive":  # there llguidance's parser gives up, at a point that depends on its path
        assert rest[("again", 0)].token_ids == []
        assert rest[("again", 0)].error == completions[("endless", 0)].error
