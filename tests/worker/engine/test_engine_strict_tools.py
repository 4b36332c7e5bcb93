"""Strict tools in ``auto`` mode on the real tiny model: once a call is open (``<tool_call>``, the
built-in model's format), every seeded continuation is a whole call to one of the tools whose
arguments validate against its schema — the model's weights are random, so only the triggered
grammar's mask makes that certain — and the text before the opening is the model's own.

The opening is handed to the engine as tokens already emitted (``Request.generated``, what a request
continued on another worker carries): the engine feeds them as the model's own output, the
constraint follows them, and sampling goes on from there. A random model does not open a call by
itself; a trained one writing the same tokens takes the same path."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import HERMES
from metrale.text.tool_calls.grammar import FunctionSpec
from metrale.text.tool_calls.parser import read_whole
from metrale.worker.engine.constraints import GrammarCompiler
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Completion, Request
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig

BLOCK = 16
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 4},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
GRAMMAR = HERMES.triggered_grammar(
    [FunctionSpec(name, schema) for name, schema in SCHEMAS.items()], first_index=0, max_calls=16
)
OPENING = "Let me look that up. <tool_call>"
PROMPT = tuple(range(40, 61))
SEEDS = range(8)
MAX_TOKENS = 128
"""Above the longest call of the schemas written a byte a token (a random model picks any tokenization
of the text the grammar forces)."""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tokenizer: Tokenizer) -> Engine:
    executor = ModelExecutor(load_model(tiny_model_dir), num_slots=8, num_blocks=96, block_size=BLOCK)
    config = SchedulerConfig(
        max_batch_tokens=128,
        max_seqs=8,
        num_slots=8,
        num_blocks=96,
        block_size=BLOCK,
        max_model_len=96 * BLOCK,
    )
    grammars = GrammarCompiler(tokenizer, executor.vocab_size)
    return Engine(executor, config, eos_token_ids=tokenizer.eos_token_ids, seed=0, grammars=grammars)


def run(engine: Engine, requests: list[Request]) -> dict[str, Completion]:
    for request in requests:
        engine.add_request(request)
    completions: dict[str, Completion] = {}
    while engine.has_unfinished():
        for output in engine.step():
            completions.setdefault(output.request_id, Completion()).extend(output)
    return completions


@pytest.mark.slow
def test_every_seeded_call_after_the_opening_is_whole_and_valid(engine: Engine, tokenizer: Tokenizer) -> None:
    opening = tuple(tokenizer.encode(OPENING))
    requests = [
        Request(f"s{seed}", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, grammar=GRAMMAR))
        for seed in SEEDS
    ]
    continued = [Request(r.request_id, r.prompt_ids, r.params, generated=opening) for r in requests]
    names = set()
    for request_id, completion in run(engine, continued).items():
        text = tokenizer.decode([*opening, *completion.token_ids])
        parsed = read_whole(HERMES.new_parser(lambda index: f"call_{index}"), text)
        assert parsed.content.startswith("Let me look that up. "), request_id
        assert parsed.calls and not parsed.cut_off, (request_id, text)
        first = parsed.calls[0]
        assert first.name in SCHEMAS, text
        call = json.loads(text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0])
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
        names.add(call["name"])
    assert names == set(SCHEMAS)  # the seeds reach both tools: the choice is the model's


def test_without_an_opening_the_model_writes_text_and_no_invalid_call(engine: Engine, tokenizer: Tokenizer) -> None:
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=seed, grammar=GRAMMAR) for seed in range(4)]
    completions = run(engine, [Request(f"t{i}", PROMPT, p) for i, p in enumerate(params)])
    for completion in completions.values():
        text = tokenizer.decode(completion.token_ids)
        parsed = read_whole(HERMES.new_parser(lambda index: f"call_{index}"), text)
        for call in parsed.calls:  # a random model hardly opens one; if it does, the call is valid
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert len(completion.token_ids) > 0
