"""The finiteness check on a table of schemas: those it calls satisfiable are, as an example value
shows (valid for jsonschema and accepted whole by the llguidance grammar built from the schema); those
it refuses admit no finite value."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest

from metrale.text.grammars import json_schema_grammar, llguidance_tokenizer
from metrale.text.schema_finiteness import admits_finite_value
from metrale.text.tokenizer import Tokenizer
from metrale.worker.model.builtin import builtin_model_dir

NODE = {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]}

SATISFIABLE: dict[str, tuple[Any, Any]] = {
    "empty": ({}, 1),
    "person": (
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        {"name": "a"},
    ),
    "optional-self-reference": (
        {"type": "object", "properties": {"child": {"$ref": "#"}, "v": {"type": "integer"}}, "required": ["v"]},
        {"v": 1},
    ),
    "tree-of-lists": (
        {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
        {"kids": []},
    ),
    "linked-list-with-a-null-end": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                    "required": ["next"],
                }
            },
            "$ref": "#/$defs/node",
        },
        {"next": None},
    ),
    "cycle-through-defs-with-an-exit": (
        {
            "$defs": {"a": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}},
            "$ref": "#/$defs/a",
        },
        "x",
    ),
    "one-of-with-a-good-branch": ({"oneOf": [{"enum": []}, {"type": "boolean"}]}, True),
    "all-of-satisfiable": ({"allOf": [NODE, {"type": "object"}]}, {"value": 3}),
    "array-min-items": ({"type": "array", "items": NODE, "minItems": 2}, [{"value": 1}, {"value": 2}]),
    "type-list-with-a-way-out": (
        {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        None,
    ),
    "definitions-draft-7": (
        {
            "definitions": {"n": {"type": "integer"}},
            "type": "array",
            "items": {"$ref": "#/definitions/n"},
            "minItems": 1,
        },
        [4],
    ),
}

UNSATISFIABLE: dict[str, Any] = {
    "self-recursive-required": {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]},
    "ref-cycle": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "self-ref": {"$ref": "#"},
    "empty-enum": {"enum": []},
    "empty-type": {"type": []},
    "not-anything": {"not": {}},
    "false": {"type": "object", "properties": {"a": False}, "required": ["a"]},
    "any-of-all-dead": {"anyOf": [{"enum": []}, {"not": {}}]},
    "empty-any-of": {"anyOf": []},
    "all-of-one-dead": {"allOf": [{"type": "string"}, {"type": []}]},
    "array-min-items-of-itself": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "tuple-prefix-dead": {"type": "array", "prefixItems": [{"enum": []}], "minItems": 1},
    "required-not-allowed": {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
    "min-properties-of-dead": {
        "type": "object",
        "properties": {"a": {"$ref": "#"}},
        "minProperties": 1,
        "additionalProperties": False,
    },
    "mutual-recursion-required": {
        "$defs": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1},
        },
        "$ref": "#/$defs/a",
    },
    "deep-in-properties": {
        "type": "object",
        "properties": {"outer": {"type": "object", "properties": {"inner": {"$ref": "#"}}, "required": ["inner"]}},
        "required": ["outer"],
    },
}


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance_tokenizer(Tokenizer.from_dir(builtin_model_dir()))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(builtin_model_dir())


@pytest.mark.parametrize("name", sorted(SATISFIABLE))
def test_a_satisfiable_schema_is_passed_and_its_example_is_a_sentence_of_its_grammar(
    name: str, tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    schema, example = SATISFIABLE[name]
    assert admits_finite_value(schema)
    jsonschema.validate(example, schema)
    matcher = llguidance.LLMatcher(ll_tokenizer, json_schema_grammar(schema), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    text = json.dumps(example, separators=(",", ":"))
    assert matcher.consume_tokens(tokenizer.encode(text)), matcher.get_error()
    assert matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(UNSATISFIABLE))
def test_an_unsatisfiable_schema_is_refused(name: str) -> None:
    assert not admits_finite_value(UNSATISFIABLE[name])


@pytest.mark.parametrize(
    "schema",
    [
        pytest.param({"$ref": "#/$defs/missing"}, id="dangling-ref"),
        pytest.param({"$ref": "https://example.com/schema.json"}, id="remote-ref"),
        pytest.param({"$ref": "#anchor"}, id="anchor"),
        pytest.param({"if": {"type": "string"}, "then": {"enum": []}}, id="if-then"),
        pytest.param({"type": "integer", "minimum": 5, "maximum": 1}, id="bounds"),
    ],
)
def test_what_it_cannot_judge_counts_as_satisfiable(schema: dict[str, Any]) -> None:
    assert admits_finite_value(schema)


def test_a_schema_nested_deeper_than_python_recurses_gets_no_verdict() -> None:
    schema: dict[str, Any] = {"enum": []}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    assert admits_finite_value(schema)


def test_a_long_chain_of_refs_is_judged_in_time() -> None:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}, "minItems": 1} for i in range(400)}
    defs["d400"] = {"type": "integer"}
    assert admits_finite_value({"$defs": defs, "$ref": "#/$defs/d0"})
    defs["d400"] = {"$ref": "#/$defs/d0"}
    assert not admits_finite_value({"$defs": defs, "$ref": "#/$defs/d0"})
