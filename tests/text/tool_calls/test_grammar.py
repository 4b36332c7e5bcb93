"""Forced-call grammars: every sentence a random sampler can draw under llguidance's mask parses into
1..max_calls calls whose arguments validate against their function's schema (the worker does the same
masking with the model's logits; here the choices are uniform among the allowed tokens)."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from metrale.text.grammars import check_grammar, llguidance_tokenizer
from metrale.text.tiktoken_vocab.kimi_writer import write_kimi_tokenizer
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import HERMES, KIMI_K2, ToolCallFormat
from metrale.text.tool_calls.grammar import FunctionSpec
from metrale.text.tool_calls.parser import parse_whole
from metrale.worker.model.builtin import builtin_model_dir

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FUNCTIONS = [FunctionSpec("get_weather", WEATHER), FunctionSpec("ping", None)]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("kimi-tokenizer")
    write_kimi_tokenizer(directory)
    return Tokenizer.from_dir(directory)


def sample(grammar: str, tokenizer: Tokenizer, seed: int) -> list[int]:
    """Tokens drawn uniformly among those the grammar allows, until it is complete."""
    ll_tokenizer = llguidance_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    rng = random.Random(seed)
    mask = allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    tokens: list[int] = []
    while not matcher.is_stopped() and len(tokens) < MAX_TOKENS:
        fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: tokenizer.vocab_size])[0]
        token = int(rng.choice(allowed.tolist()))
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    assert matcher.is_accepting(), "the grammar did not complete within the budget"
    return tokens


@pytest.mark.parametrize("tool_format", [KIMI_K2, HERMES], ids=["kimi_k2", "hermes"])
@pytest.mark.parametrize("max_calls", [1, 4])
def test_every_sampled_sentence_is_valid_calls(
    tool_format: ToolCallFormat, max_calls: int, kimi_tokenizer: Tokenizer
) -> None:
    tokenizer = kimi_tokenizer if tool_format is KIMI_K2 else Tokenizer.from_dir(builtin_model_dir())
    grammar = tool_format.forced_grammar(FUNCTIONS, first_index=2, max_calls=max_calls)
    check_grammar(grammar, tokenizer)
    schemas = {f.name: f.parameters or {"type": "object", "maxProperties": 0} for f in FUNCTIONS}
    counts = set()
    for seed in range(20):
        tokens = sample(grammar, tokenizer, seed)
        text = tokenizer.decode(tokens, skip_special_tokens=not tool_format.keeps_special_tokens)
        content, calls = parse_whole(tool_format.new_parser(lambda i: f"call_{i}"), text)
        assert content == ""
        assert 1 <= len(calls) <= max_calls
        counts.add(len(calls))
        for position, call in enumerate(calls):
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            if tool_format is KIMI_K2:
                assert call.id == f"functions.{call.name}:{2 + position}"
    assert (max_calls == 1) == (counts == {1})


def test_a_grammar_with_an_unsupported_schema_is_refused_naming_it(kimi_tokenizer: Tokenizer) -> None:
    bad = FunctionSpec("f", {"type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}})
    grammar = KIMI_K2.forced_grammar([bad], first_index=0, max_calls=1)
    with pytest.raises(ValueError, match="no-such-format"):
        check_grammar(grammar, kimi_tokenizer)
