"""``response_format`` (structured outputs) to the grammar a worker constrains decoding with.

``{"type": "text"}`` leaves decoding free; ``{"type": "json_object"}`` allows any JSON object;
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` allows the
JSON texts that validate against ``schema``. As in vLLM, the schema constrains decoding whatever
``strict`` says, on chat and text completions alike. Every grammar a request carries (this one, or
a forced tool call's) is compiled here against the model's tokenizer first, so that a schema or
grammar llguidance cannot follow is a 400 naming the construct rather than a worker's refusal, and
a schema no finite JSON value satisfies (``text/schema_finiteness.py``) is a 400 too, rather than a
decode that reaches a dead end. With tools, the tool plan's grammar is the request's: it holds the
format's answer beside the calls in ``auto`` mode, and a forced call's turn has no text answer for
the format to shape (as OpenAI serves both).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import llguidance

from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.request_bodies import ResponseFormat, SamplingFields
from metrale.shared.errors import BadRequest
from metrale.text.grammars import GrammarError, check_grammar, json_object_grammar, json_schema_grammar
from metrale.text.grammars import llguidance_tokenizer as build_llguidance_tokenizer
from metrale.text.schema_finiteness import admits_finite_value
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.grammar import FunctionSpec

_ENDLESS = (
    "admits no finite JSON value (a required property, item or $ref cycle that never ends, an empty enum, "
    "type or anyOf, or 'not: {}'): decoding could never complete it"
)

_LLGUIDANCE_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()


def response_format_grammar(response_format: ResponseFormat | None) -> str | None:
    """The grammar ``response_format`` asks for; None for free text. Raises ``BadRequest``."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return json_object_grammar()
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise BadRequest(
            "response_format of type 'json_schema' needs json_schema.schema (a JSON schema object)",
            param="response_format",
        )
    if not admits_finite_value(spec.schema_):
        raise BadRequest(f"response_format.json_schema.schema {_ENDLESS}", param="response_format")
    try:
        return json_schema_grammar(spec.schema_)
    except GrammarError as error:
        raise BadRequest(f"response_format.json_schema.schema: {error}", param="response_format") from error


def refuse_endless_functions(functions: Sequence[FunctionSpec]) -> None:
    """400 naming the first of the forced ``functions`` whose ``parameters`` admit no finite value:
    a call to it could never be completed."""
    for function in functions:
        if function.parameters is not None and not admits_finite_value(function.parameters):
            raise BadRequest(
                f"the parameters schema of function {function.name!r} {_ENDLESS} (a call to it is forced)",
                param="tools",
            )


def request_grammar(
    body: SamplingFields, model: ServedModel, tool_grammar: str | None = None, tool_param: str = "tool_choice"
) -> str | None:
    """The grammar the worker must constrain ``body``'s completions with, checked against ``model``.

    ``tool_grammar`` is the request's tool plan's (``api/prepare/tools.py``), its errors blamed on
    ``tool_param``: a forced call's (``tool_choice`` ``required`` or a named function), or, in
    ``auto`` mode, the one strict tools follow or, with a ``response_format`` that constrains, the
    format's answer or calls. Where there is one it is the grammar: the plan already holds the format
    wherever the format applies (a forced turn gives no text answer for it to shape). The format's
    grammar is still checked, a 400 naming ``response_format``. Raises ``BadRequest``.
    """
    format_grammar = response_format_grammar(body.response_format)
    grammar = tool_grammar if tool_grammar is not None else format_grammar
    if grammar is None:
        return None
    if body.ignore_eos and not body.stop_token_ids:
        raise BadRequest(
            "a constrained completion ends on a stop token once complete: ignore_eos needs stop_token_ids",
            param="ignore_eos",
        )
    tokenizer = llguidance_tokenizer(model)
    if format_grammar is not None:
        try:
            check_grammar(format_grammar, tokenizer)
        except GrammarError as error:
            raise BadRequest(f"unsupported schema: {error}", param="response_format") from error
    if tool_grammar is not None:
        try:
            check_grammar(tool_grammar, tokenizer)
        except GrammarError as error:
            raise BadRequest(f"unsupported grammar: {error}", param=tool_param) from error
    return grammar


def llguidance_tokenizer(model: ServedModel) -> llguidance.LLTokenizer:
    """``model``'s tokenizer as llguidance needs it, built once per tokenizer the gateway holds."""
    cached = _LLGUIDANCE_TOKENIZERS.get(model.tokenizer)
    if cached is None:
        width = max(model.vocab_size, model.tokenizer.vocab_size)
        cached = _LLGUIDANCE_TOKENIZERS[model.tokenizer] = build_llguidance_tokenizer(model.tokenizer, width)
    return cached
