"""What a ``responses.create`` body may ask for: each field honoured, or refused with a 400 naming it.

Honoured: ``input``, ``instructions``, ``chat_template_kwargs`` (vLLM's), ``previous_response_id``,
``store``, ``stream``, ``background`` (with ``store``: the response runs as a batch runner's job, kept
in Redis), ``model``, ``temperature``,
``top_p``, ``max_output_tokens``, ``metadata``, ``user`` and ``safety_identifier`` (they name the end
user; they do not change the output), function ``tools`` with ``tool_choice``, ``parallel_tool_calls``
and ``max_tool_calls``, ``text.format``, ``truncation: "disabled"`` (a prompt over the context is a
400, as OpenAI's default), ``service_tier`` ``auto`` / ``default``, and ``include`` values about items
a Metrale response never holds (web search, file search, code interpreter, computer and image items:
there is nothing to include). Refused when they ask for something: ``include`` of
``message.output_text.logprobs`` and ``top_logprobs`` (Responses logprobs are not served yet),
``reasoning.encrypted_content`` (nothing is encrypted), ``truncation: "auto"`` (a conversation
continues from its exact tokens, so dropping its start is not done), ``reasoning.effort`` and
``reasoning.summary`` (no effort setting, no summaries: a thinking model's reasoning comes whole as a
``reasoning`` output item; ``chat_template_kwargs`` switches it off), ``text.verbosity``,
``background`` with ``store: false``, ``conversation``, ``prompt``, the prompt-cache fields (Metrale
reuses prompts by its own checkpoints), ``context_management``, ``access_programs``,
``background_options``, ``image``, ``moderation``; and chat's ``max_tokens``, ``stop``,
``response_format``, ``session``, ``n`` other than 1, ``stream_options.include_usage``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metrale.gateway.metadata import check_metadata
from metrale.gateway.unsupported_fields import SUPPORTED_SERVICE_TIERS
from metrale.shared.errors import BadRequest

if TYPE_CHECKING:
    from metrale.gateway.responses.bodies import ResponseCreateRequest

NOTHING_TO_INCLUDE = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
"""``include`` values about items a Metrale response never holds (their tools and inputs are refused)."""

_CANNOT_INCLUDE = {
    "reasoning.encrypted_content": "Metrale does not encrypt reasoning: continue a conversation with "
    "'previous_response_id' (store: true), or replay its items",
    "message.output_text.logprobs": "log probabilities are not served by /v1/responses yet (chat completions "
    "serves them)",
}

_CHAT_FIELDS = {
    "max_tokens": "use 'max_output_tokens'",
    "stop": "the Responses API has no stop strings",
    "response_format": "use 'text.format'",
    "session": "continue a conversation with 'previous_response_id'",
}

_NOT_SERVED = {
    "conversation": "the Conversations API is not served: continue with 'previous_response_id'",
    "prompt": "reusable prompts are not served: send 'instructions' and 'input'",
    "prompt_cache_key": "Metrale reuses prompts by its own checkpoints ('previous_response_id')",
    "prompt_cache_retention": "Metrale reuses prompts by its own checkpoints ('previous_response_id')",
    "prompt_cache_options": "Metrale reuses prompts by its own checkpoints ('previous_response_id')",
    "context_management": "context compaction is not served",
    "access_programs": "access programs are not served",
    "background_options": "background responses are not served",
    "image": "images are not served by this model (it reads text only)",
    "moderation": "moderation is not served",
}


def refuse_unsupported(body: ResponseCreateRequest) -> None:
    """Raise ``BadRequest`` naming the first field of ``body`` that asks for what Metrale does not do."""
    if body.background and not body.store:
        why = "Background responses are kept in the store until they end: send 'store': true with 'background'."
        raise BadRequest(why, param="background")
    for name, why in _CHAT_FIELDS.items():
        if name in body.model_fields_set:
            raise BadRequest(f"'{name}' is not a /v1/responses parameter: {why}.", param=name)
    for name, why in _NOT_SERVED.items():
        if getattr(body, name) not in (None, [], {}):
            raise BadRequest(f"'{name}' is not supported: {why}.", param=name)
    if body.stream_options is not None and "include_usage" in body.stream_options.model_fields_set:
        raise BadRequest(
            "'stream_options.include_usage' is chat's: a response always reports usage.", param="stream_options"
        )
    _require(body.n == 1, "A response has one output: 'n' must be 1.", "n")
    tier = body.service_tier
    ok_tier = tier is None or tier in SUPPORTED_SERVICE_TIERS
    _require(ok_tier, f"service_tier must be one of {list(SUPPORTED_SERVICE_TIERS)}, got {tier!r}.", "service_tier")
    _refuse_include(body.include or [])
    top = body.top_logprobs
    _require(not top, f"top_logprobs ({top}) needs logprobs, which /v1/responses does not serve yet.", "top_logprobs")
    _require(
        body.truncation in (None, "disabled"),
        f"truncation {body.truncation!r} is not supported: only 'disabled' (a conversation continues from its "
        "exact tokens, so its start is never dropped; a prompt over the context is a 400).",
        "truncation",
    )
    _refuse_reasoning(body)
    _refuse_text(body)
    max_calls = body.max_tool_calls
    _require(max_calls is None or max_calls >= 1, f"max_tool_calls must be >= 1, got {max_calls}.", "max_tool_calls")
    check_metadata(body.metadata)


def _refuse_include(include: list[str]) -> None:
    for value in include:
        if value in _CANNOT_INCLUDE:
            raise BadRequest(f"include {value!r} is not supported: {_CANNOT_INCLUDE[value]}.", param="include")
        if value not in NOTHING_TO_INCLUDE:
            raise BadRequest(f"include {value!r} is not a value the Responses API defines.", param="include")


def _refuse_reasoning(body: ResponseCreateRequest) -> None:
    """``reasoning`` asks for an effort or a summary; neither can be given. A thinking model's
    reasoning comes whole, as a ``reasoning`` item's text; how much it thinks has no knob in these
    models' templates beyond ``enable_thinking`` (as vLLM serves them)."""
    reasoning = body.reasoning
    if reasoning is None:
        return
    if reasoning.effort is not None:
        raise BadRequest(
            f"reasoning.effort {reasoning.effort!r} is not supported: the models Metrale serves have no reasoning "
            "effort setting; a thinking model's reasoning is switched off with "
            "'chat_template_kwargs': {'enable_thinking': false}.",
            param="reasoning",
        )
    summary = reasoning.summary or reasoning.generate_summary
    _require(
        summary is None,
        f"reasoning.summary {summary!r} is not supported: no summary is written; a thinking model's reasoning "
        "comes whole as a 'reasoning' output item's content.",
        "reasoning",
    )


def _refuse_text(body: ResponseCreateRequest) -> None:
    if body.text is None:
        return
    _require(body.text.verbosity is None, "text.verbosity is not supported.", "text.verbosity")
    text_format = body.text.format
    if text_format is None:
        return
    kinds = ("text", "json_object", "json_schema")
    kind_ok = text_format.type in kinds
    _require(kind_ok, f"text.format.type must be one of {', '.join(kinds)}, got {text_format.type!r}.", "text.format")
    if text_format.type == "json_schema":
        _require(text_format.name is not None, "text.format of type json_schema needs a 'name'.", "text.format.name")
        has_schema = text_format.schema_ is not None
        _require(has_schema, "text.format of type json_schema needs a 'schema' object.", "text.format.schema")
    else:
        spare = sorted(
            name for name in ("name", "description", "schema_", "strict") if getattr(text_format, name) is not None
        )
        why = f"text.format of type {text_format.type!r} takes no {', '.join(spare).replace('schema_', 'schema')}."
        _require(not spare, why, "text.format")


def _require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise BadRequest(message, param=param)
