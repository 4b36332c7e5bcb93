"""The grammar constraint of one choice: masks, stop tokens, replay, the compile cache, and the
parallel mask against its plain twin."""

from __future__ import annotations

import random
from pathlib import Path

import llguidance
import pytest
import torch

from metrale.text.grammars import GrammarError, json_schema_grammar
from metrale.text.tiktoken_vocab.kimi_writer import write_kimi_tokenizer
from metrale.text.tokenizer import Tokenizer
from metrale.worker.engine.constraints import (
    ChoiceConstraint,
    GrammarCompiler,
    allowed_tokens,
    allowed_tokens_reference,
    unpack_bitmask,
    unpack_bitmask_reference,
)
from metrale.worker.model.builtin import builtin_model_dir

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA)
PADDING = 3  # the model's logits are wider than the tokenizer's vocabulary


@pytest.fixture(scope="module", params=["tokenizer.json", "tiktoken"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "tokenizer.json":
        return Tokenizer.from_dir(builtin_model_dir())
    directory: Path = tmp_path_factory.mktemp("kimi")
    write_kimi_tokenizer(directory)
    return Tokenizer.from_dir(directory)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + PADDING)


@pytest.fixture(scope="module")
def executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor(num_threads=2)


def stops(tokenizer: Tokenizer) -> frozenset[int]:
    return frozenset(tokenizer.eos_token_ids)


def walk(constraint: ChoiceConstraint, rng: random.Random, executor: llguidance.LLExecutor) -> list[int]:
    """Sample uniformly among allowed tokens until a stop token; the output."""
    output: list[int] = []
    for _ in range(200):
        constraint.follow(output)
        (allowed,) = allowed_tokens([constraint], executor)
        token = rng.choice(torch.nonzero(allowed).flatten().tolist())
        output.append(token)
        if token in constraint.stop_token_ids:
            return output
    raise AssertionError("the walk never ended")


def test_a_walk_through_allowed_tokens_spells_valid_json_and_ends_on_a_stop_token(
    tokenizer: Tokenizer, compiler: GrammarCompiler, executor: llguidance.LLExecutor
) -> None:
    import json

    import jsonschema

    rng = random.Random(0)
    for _ in range(20):
        output = walk(ChoiceConstraint(compiler.compile(GRAMMAR), stops(tokenizer)), rng, executor)
        assert output[-1] in stops(tokenizer)
        jsonschema.validate(json.loads(tokenizer.decode(output[:-1])), SCHEMA)


def test_stop_tokens_are_allowed_exactly_when_the_grammar_is_complete(
    tokenizer: Tokenizer, compiler: GrammarCompiler, executor: llguidance.LLExecutor
) -> None:
    constraint = ChoiceConstraint(compiler.compile(GRAMMAR), stops(tokenizer))
    stop_ids = sorted(stops(tokenizer))
    prefix = tokenizer.encode('{"name":"ab","n":4')
    constraint.follow(prefix)
    (allowed,) = allowed_tokens([constraint], executor)
    assert not allowed[stop_ids].any() and not constraint.is_accepting
    constraint.follow([*prefix, *tokenizer.encode("}")])
    (allowed,) = allowed_tokens([constraint], executor)
    assert constraint.is_accepting
    assert torch.nonzero(allowed).flatten().tolist() == stop_ids  # complete: only the stop tokens
    assert not allowed[-PADDING:].any()


def test_replaying_an_output_masks_exactly_as_following_it_token_by_token(
    tokenizer: Tokenizer, compiler: GrammarCompiler, executor: llguidance.LLExecutor
) -> None:
    rng = random.Random(1)
    output = walk(ChoiceConstraint(compiler.compile(GRAMMAR), stops(tokenizer)), rng, executor)
    stepwise = ChoiceConstraint(compiler.compile(GRAMMAR), stops(tokenizer))
    for length in range(len(output)):
        stepwise.follow(output[:length])
        replayed = ChoiceConstraint(compiler.compile(GRAMMAR), stops(tokenizer))
        replayed.follow(output[:length])  # a new matcher, as after a fork, checkpoint or failover
        assert replayed.consumed == stepwise.consumed
        assert torch.equal(allowed_tokens([replayed], executor), allowed_tokens([stepwise], executor))
    assert stepwise.replays == 0


def test_an_output_that_is_not_a_continuation_rebuilds_the_matcher_by_replay(
    tokenizer: Tokenizer, compiler: GrammarCompiler, executor: llguidance.LLExecutor
) -> None:
    constraint = ChoiceConstraint(compiler.compile(GRAMMAR), stops(tokenizer))
    constraint.follow(tokenizer.encode('{"name":"xy'))
    other = tokenizer.encode('{"name":"q","n":')
    constraint.follow(other)
    assert constraint.replays == 1 and constraint.consumed == tuple(other)
    fresh = ChoiceConstraint(compiler.compile(GRAMMAR), stops(tokenizer))
    fresh.follow(other)
    assert torch.equal(allowed_tokens([constraint], executor), allowed_tokens([fresh], executor))


def test_a_token_outside_the_grammar_leaves_only_the_stop_tokens(
    tokenizer: Tokenizer, compiler: GrammarCompiler, executor: llguidance.LLExecutor
) -> None:
    constraint = ChoiceConstraint(compiler.compile(GRAMMAR), stops(tokenizer))
    constraint.follow(tokenizer.encode("[1"))  # a corrupted continuation
    assert constraint.is_error
    for masks in (allowed_tokens([constraint], executor), allowed_tokens_reference([constraint])):
        assert torch.nonzero(masks[0]).flatten().tolist() == sorted(stops(tokenizer))


def test_the_parallel_masks_equal_the_plain_twin_along_random_walks(
    tokenizer: Tokenizer, compiler: GrammarCompiler, executor: llguidance.LLExecutor
) -> None:
    rng = random.Random(2)
    grammars = [GRAMMAR, json_schema_grammar({"type": "object"}), 'start: "yes" | "no" | /[0-9]{1,3}/']
    constraints = [ChoiceConstraint(compiler.compile(g), stops(tokenizer)) for g in grammars for _ in range(3)]
    outputs: list[list[int]] = [[] for _ in constraints]
    for _ in range(12):
        for constraint, output in zip(constraints, outputs, strict=True):
            constraint.follow(output)
        parallel, serial = allowed_tokens(constraints, executor), allowed_tokens(constraints)
        plain = allowed_tokens_reference(constraints)
        assert torch.equal(parallel, plain) and torch.equal(serial, plain)
        for row, output in zip(plain, outputs, strict=True):
            if not output or output[-1] not in stops(tokenizer):
                output.append(rng.choice(torch.nonzero(row).flatten().tolist()))


@pytest.mark.parametrize("unpack", [unpack_bitmask, unpack_bitmask_reference], ids=["numpy", "shifts"])
def test_unpack_bitmask_reads_bit_j_mod_32_of_word_j_div_32(unpack: object) -> None:
    words = torch.tensor([[1 - 2**31, 0b101]], dtype=torch.int32)  # bits 0 and 31 set
    assert torch.nonzero(unpack(words, 35)[0]).flatten().tolist() == [0, 31, 32, 34]  # type: ignore[operator]
    assert unpack(words, 33).shape == (1, 33)  # type: ignore[operator]


def test_the_numpy_unpacking_equals_the_shifts_on_random_words() -> None:
    generator = torch.Generator().manual_seed(4)
    for vocab_size in (1, 31, 32, 33, 517, 4101):
        words = torch.randint(-(2**31), 2**31, (5, -(-vocab_size // 32)), dtype=torch.int32, generator=generator)
        assert torch.equal(unpack_bitmask(words, vocab_size), unpack_bitmask_reference(words, vocab_size))


def test_the_compiler_caches_by_text_and_evicts_the_least_recently_used(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, cache_size=2)
    first = compiler.compile('start: "a"')
    assert compiler.compile('start: "a"') is first
    compiler.compile('start: "b"')
    compiler.compile('start: "a"')  # used again: "b" is now the oldest
    compiler.compile('start: "c"')
    assert compiler.cached == 2
    assert compiler.compile('start: "a"') is first
    with pytest.raises(GrammarError, match="Unimplemented keys"):
        compiler.compile(json_schema_grammar({"not": {}}))


def test_a_constraint_needs_a_stop_token_inside_the_vocabulary(compiler: GrammarCompiler) -> None:
    with pytest.raises(ValueError, match="needs a stop token"):
        ChoiceConstraint(compiler.compile(GRAMMAR), [compiler.vocab_size + 10])
