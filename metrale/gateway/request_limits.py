"""What one request may ask for, checked as soon as its body is parsed (``api/prepare/intake.py``), before its
model is looked up, its prompt rendered or tokenized, or a grammar compiled (contract 9).

The bounds are ``RequestLimits`` (``MET_MAX_*``, defaults and why in ``shared/settings.py``): the
number and length of ``stop`` strings, ``stop_token_ids`` and ``logit_bias`` entries, ``tools`` and
each tool's JSON size, a ``response_format`` schema's JSON size, the enum values of a schema or a
tool's, chat messages or Responses input items, and the work of the answer (``check_request_work``).
Each refusal is a 400 naming the parameter, the limit's variable and its value. A schema's size is
measured by a walk that stops once the limit is passed, so a refusal costs at most the limit.

The work of an answer is ``n x max_tokens x (1 + alternatives)`` token slots: checked here when the
body sets ``max_tokens``, and again once the prompt is tokenized (without ``max_tokens`` a choice may
take what the context leaves).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from metrale.gateway.request_bodies import ChatCompletionRequest, CompletionRequest, SamplingFields
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.shared.errors import BadRequest
from metrale.shared.messages import GenerateRequest
from metrale.shared.settings import RequestLimits

MAX_LOGIT_BIAS_ENTRIES = 300
"""The most tokens one ``logit_bias`` may name (OpenAI's limit; the worker's too, so not settable)."""


def check_request_limits(body: SamplingFields, limits: RequestLimits) -> None:
    """Refuse (``BadRequest``, 400) a body that asks for more than ``limits`` allow."""
    _check_stops(body.stop_strings, limits)
    _at_most("stop_token_ids", len(body.stop_token_ids), limits.max_stop_token_ids, "MET_MAX_STOP_TOKEN_IDS", "ids")
    _at_most("logit_bias", len(body.logit_bias or ()), MAX_LOGIT_BIAS_ENTRIES, None, "tokens")
    if body.response_format is not None and body.response_format.json_schema is not None:
        schema = body.response_format.json_schema.schema_
        if schema is not None:
            _check_schema(schema, "response_format", limits.max_schema_bytes, "MET_MAX_SCHEMA_BYTES", limits)
    if isinstance(body, ChatCompletionRequest):
        _check_chat(body, limits)
    elif isinstance(body, CompletionRequest):
        _check_completion(body, limits)
    elif isinstance(body, ResponseCreateRequest):
        items = len(body.input) if isinstance(body.input, list) else 1
        _at_most("input", items, limits.max_messages, "MET_MAX_MESSAGES", "items")
        _check_tools(body.tools, limits)
        text_format = body.text_format
        if text_format is not None and text_format.schema_ is not None:
            _check_schema(text_format.schema_, "text.format", limits.max_schema_bytes, "MET_MAX_SCHEMA_BYTES", limits)
        _check_early_work(1, body.max_output_tokens, 0, limits, param="max_output_tokens")


def check_request_work(n: int, max_tokens: int, alternatives: int, limits: RequestLimits, *, param: str) -> None:
    """Refuse a request whose answer may hold more than ``max_request_work`` token slots: ``n`` choices of
    ``max_tokens`` tokens, each with its own logprob and ``alternatives`` more."""
    work = n * max_tokens * (1 + max(alternatives, 0))
    if work > limits.max_request_work:
        raise BadRequest(
            f"This request may produce {work} token slots (n {n} x max tokens {max_tokens} x "
            f"(1 + {alternatives} logprob alternatives)); the limit is {limits.max_request_work} "
            "(MET_MAX_REQUEST_WORK): lower n, the token limit or the logprobs asked for.",
            param=param,
        )


def check_generate_work(request: GenerateRequest, limits: RequestLimits, *, param: str) -> None:
    """``check_request_work`` for a request whose ``max_tokens`` is resolved (the context's room when
    the body set none)."""
    check_requests_work([request], limits, param=param)


def check_requests_work(
    requests: Sequence[GenerateRequest], limits: RequestLimits, *, param: str, prompt_param: str = "prompt_logprobs"
) -> None:
    """Refuse the fleet requests of one client request (one per prompt) whose answers may hold more
    than ``max_request_work`` token slots together: each one's ``n x max_tokens x (1 + alternatives)``
    and, when it asks for prompt logprobs, ``prompt tokens x (1 + alternatives)``. Blamed on
    ``prompt_param`` when the prompt logprobs alone pass the bound, else on ``param``."""
    answers = sum(request.n * request.max_tokens * (1 + (request.logprobs or 0)) for request in requests)
    prompts = sum(
        len(request.prompt_token_ids) * (1 + request.prompt_logprobs)
        for request in requests
        if request.prompt_logprobs is not None
    )
    if answers + prompts <= limits.max_request_work:
        return
    blamed = prompt_param if prompts > limits.max_request_work else param
    raise BadRequest(
        f"This request may produce {answers + prompts} token slots ({len(requests)} prompts: {answers} for "
        f"the answers (n x max tokens x (1 + logprob alternatives)), {prompts} for the prompts' logprobs); "
        f"the limit is {limits.max_request_work} (MET_MAX_REQUEST_WORK): lower {blamed}.",
        param=blamed,
    )


MAX_PROMPTS = 1024
"""The most prompts one ``/v1/completions`` request may list."""


def _check_completion(body: CompletionRequest, limits: RequestLimits) -> None:
    """The number of prompts, and the answer's work once per prompt."""
    prompts = len(body.prompts)
    _at_most("prompt", prompts, MAX_PROMPTS, None, "prompts")
    param = "prompt" if prompts > 1 else "max_tokens"
    _check_early_work(body.n * max(prompts, 1), body.token_budget, body.logprobs or 0, limits, param=param)


def _check_chat(body: ChatCompletionRequest, limits: RequestLimits) -> None:
    _at_most("messages", len(body.messages), limits.max_messages, "MET_MAX_MESSAGES", "messages")
    _check_tools(body.tools, limits)
    alternatives = (body.top_logprobs or 0) if body.logprobs else 0
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    _check_early_work(body.n, body.token_budget, alternatives, limits, param=param)


def _check_tools(tools: Sequence[Mapping[str, Any]] | None, limits: RequestLimits) -> None:
    if tools is not None:
        _at_most("tools", len(tools), limits.max_tools, "MET_MAX_TOOLS", "tools")
        for position, tool in enumerate(tools):
            _check_schema(tool, "tools", limits.max_tool_bytes, "MET_MAX_TOOL_BYTES", limits, f"tools[{position}]")


def _check_early_work(n: int, budget: int | None, alternatives: int, limits: RequestLimits, *, param: str) -> None:
    """``check_request_work`` for a body that sets its token limit (values out of range are refused
    later, with their own errors)."""
    if budget is not None and n >= 1 and budget >= 1:
        check_request_work(n, budget, alternatives, limits, param=param)


def _check_stops(stops: Sequence[str], limits: RequestLimits) -> None:
    _at_most("stop", len(stops), limits.max_stop_strings, "MET_MAX_STOP_STRINGS", "strings")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise BadRequest(
            f"stop strings may be at most {limits.max_stop_string_chars} characters long "
            f"(MET_MAX_STOP_STRING_CHARS), got one of {longest}.",
            param="stop",
        )


def _check_schema(
    value: Mapping[str, Any], param: str, max_chars: int, variable: str, limits: RequestLimits, where: str = ""
) -> None:
    """``value`` (a schema, or a tool with one) must be at most ``max_chars`` of JSON and hold at most
    ``max_schema_enum_values`` enum values."""
    size = measure_json(value, stop_after=max_chars)
    what = where or param
    if size.chars > max_chars:
        raise BadRequest(
            f"{what} is larger than {max_chars} characters of JSON ({variable}).",
            param=param,
        )
    if size.enum_values > limits.max_schema_enum_values:
        raise BadRequest(
            f"{what} holds {size.enum_values} enum values; the limit is {limits.max_schema_enum_values} "
            "(MET_MAX_SCHEMA_ENUM_VALUES).",
            param=param,
        )


def _at_most(param: str, count: int, limit: int, variable: str | None, unit: str) -> None:
    if count > limit:
        named = f"{limit} ({variable})" if variable is not None else str(limit)
        raise BadRequest(f"{param} may hold at most {named} {unit}, got {count}.", param=param)


@dataclass(slots=True)
class JsonSize:
    """About how long a JSON value is written compactly (``chars``; escapes not counted), and how many
    values the ``enum`` lists inside it hold."""

    chars: int = 0
    enum_values: int = 0


def measure_json(value: Any, *, stop_after: int) -> JsonSize:
    """The ``JsonSize`` of ``value`` (parsed JSON: dicts, lists, strings, numbers, booleans, None).

    The walk stops as soon as ``chars`` passes ``stop_after``, so it costs O(``stop_after``) whatever the
    size of ``value``; past that the counts are partial (and ``chars`` over the limit)."""
    size = JsonSize()
    stack = [value]
    while stack and size.chars <= stop_after:
        item = stack.pop()
        if isinstance(item, dict):
            size.chars += 2 + len(item)  # the braces, and a colon and (about) a comma a member
            enum = item.get("enum")
            size.enum_values += len(enum) if isinstance(enum, list) else 0
            for key, member in islice(item.items(), stop_after):  # a member takes a character at least
                size.chars += len(key) + 2
                stack.append(member)
        elif isinstance(item, list):
            size.chars += 2 + len(item)
            stack.extend(item[:stop_after])
        elif isinstance(item, str):
            size.chars += len(item) + 2
        else:
            size.chars += len(str(item))
    return size
