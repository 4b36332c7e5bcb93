"""Grammars that constrain a completion: llguidance Lark text, built and checked against a tokenizer.

A grammar travels as llguidance's Lark syntax (``GenerateRequest.grammar``): rules, string literals,
regular expressions, special tokens written ``<|name|>``, and JSON schemas embedded with
``%json { ... }``. The gateway builds one from ``response_format`` (``json_object_grammar``,
``json_schema_grammar``) or a forced tool call, checks it with ``check_grammar`` (a 400 naming what is
unsupported), and the worker compiles it against the same tokenizer
(``metrale.worker.engine.constraints``).

JSON is generated without free whitespace between tokens (llguidance's ``whitespace_flexible``
off, as OpenAI's and vLLM's strict outputs do), unless a schema sets its own ``x-guidance`` options:
a model cannot then spend its token budget on blanks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import llguidance

from metrale.text.tokenizer import Tokenizer

__all__ = [
    "GrammarError",
    "alternative_grammars",
    "check_grammar",
    "json_object_grammar",
    "json_schema_grammar",
    "llguidance_tokenizer",
]

JSON_OPTIONS: Mapping[str, Any] = {"whitespace_flexible": False}
"""llguidance's JSON compile options (``x-guidance``) for schemas that do not set their own."""


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot constrain decoding; the message names the construct."""


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """A grammar whose only sentences are JSON texts that validate against ``schema``.

    Raises ``GrammarError`` when ``schema`` is not a JSON object (a dict that ``json`` can write);
    whether llguidance supports every keyword is ``check_grammar``'s question.
    """
    if not isinstance(schema, Mapping):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    with_options = dict(schema) if "x-guidance" in schema else {**schema, "x-guidance": dict(JSON_OPTIONS)}
    try:
        text = json.dumps(with_options, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise GrammarError(f"the JSON schema is not JSON: {error}") from error
    return f"start: %json {text}\n"


def json_object_grammar() -> str:
    """A grammar for any JSON object (``response_format`` ``{"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def alternative_grammars(named: Mapping[str, str]) -> str:
    """A grammar whose sentences are those of any one of the ``named`` Lark grammars.

    llguidance's top-level grammar: a first Lark grammar ``start: @a | @b ...`` followed by each of
    ``named`` as a side grammar it references by name, so no rule of one can collide with another's.
    The result is llguidance JSON (``{"grammars": [...]}``), which ``check_grammar`` and the worker
    compile as they do Lark text. Raises ``ValueError`` for fewer than two grammars, a name that is not
    a lowercase identifier (or is ``alternatives``, the first grammar's), or a grammar that is itself
    llguidance JSON rather than Lark.
    """
    if len(named) < 2:
        raise ValueError("alternatives need at least two grammars")
    for name, grammar in named.items():
        if _SIDE_GRAMMAR_NAME.fullmatch(name) is None or name == "alternatives":
            raise ValueError(f"a side grammar's name must be a lowercase identifier, got {name!r}")
        if grammar.lstrip().startswith("{"):
            raise ValueError(f"grammar {name!r} is llguidance JSON; alternatives take Lark grammars")
    choice = " | ".join(f"@{name}" for name in named)
    grammars = [{"name": "alternatives", "lark_grammar": f"%llguidance {{}}\nstart: {choice}\n"}]
    grammars += [{"name": name, "lark_grammar": grammar} for name, grammar in named.items()]
    return json.dumps({"grammars": grammars}, ensure_ascii=False)


_SIDE_GRAMMAR_NAME = re.compile(r"[a-z][a-z0-9_]*")


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """``tokenizer`` as llguidance sees it: the same ``tokenizers`` backend (a tiktoken folder's
    converted one too), its special tokens, and its EOS ids.

    ``vocab_size`` is the width of the model's logits when it pads the vocabulary past the
    tokenizer's ids (the extra ids are never allowed). Building one takes milliseconds for small
    vocabularies and about a second for a large one: build it once per tokenizer.
    """
    size = tokenizer.vocab_size if vocab_size is None else vocab_size
    if size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size {size} is smaller than the tokenizer's {tokenizer.vocab_size} ids")
    eos = sorted(tokenizer.eos_token_ids)
    return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=size, eos_token=eos or None)


def check_grammar(grammar: str, tokenizer: Tokenizer | llguidance.LLTokenizer) -> None:
    """Raise ``GrammarError`` unless ``grammar`` compiles for ``tokenizer``; the message is
    llguidance's first line (e.g. ``Unimplemented keys: ["if", "then"]``, ``Unknown format: x``,
    ``unknown special token: "<|x|>"``)."""
    if not grammar.strip():
        raise GrammarError("the grammar is empty")
    ll_tokenizer = tokenizer if isinstance(tokenizer, llguidance.LLTokenizer) else llguidance_tokenizer(tokenizer)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    if is_error:
        raise GrammarError(grammar_error_summary(messages[0] if messages else "invalid grammar"))


def grammar_error_summary(message: str) -> str:
    """llguidance's error on one line, without its position prefix and its excerpt of the grammar."""
    kept: list[str] = []
    for line in message.strip().splitlines():
        if _SOURCE_EXCERPT.match(line):
            break  # llguidance quotes the grammar from here on
        if line.strip() and line.strip(" ^") != "":
            kept.append(line.strip())
    summary = _POSITION_PREFIX.sub("", " ".join(kept)) or "invalid grammar"
    return summary.removeprefix("failed to compile JSON schema: ")


_SOURCE_EXCERPT = re.compile(r"^\s+\d+ \|")
_POSITION_PREFIX = re.compile(r"^(at )?\d+\(\d+\): ")
