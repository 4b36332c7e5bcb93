"""Response objects as the official client reads them (``openai.types.responses.Response``), as JSON values."""

from __future__ import annotations

from typing import Any

from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.shared.messages import FinishReason, Usage


def output_message(message_id: str, text: str, status: str) -> dict[str, Any]:
    """The assistant's message item (``ResponseOutputMessage``)."""
    content = [text_part(text)] if status != "in_progress" else []
    return {"id": message_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The model's reasoning as an item (``ResponseReasoningItem``): its own words in one
    ``reasoning_text`` part (none while in progress), no summary (none is written)."""
    content = [reasoning_part(text)] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def reasoning_part(text: str) -> dict[str, Any]:
    """A ``reasoning_text`` content part."""
    return {"type": "reasoning_text", "text": text}


def text_part(text: str) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_json(usage: Usage) -> dict[str, Any]:
    """``ResponseUsage``: ``cached_tokens`` are the input tokens resumed from a checkpoint."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_json(
    *,
    response_id: str,
    created_at: float,
    body: ResponseCreateRequest,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None = None,
    finish_reason: FinishReason | None = None,
) -> dict[str, Any]:
    """The ``response`` object; ``status`` is ``in_progress``, ``completed`` or ``incomplete`` (the
    output hit ``max_output_tokens`` or the context's end), or for a background response also
    ``queued``, ``failed`` or ``cancelled``. The request's settings are echoed as served."""
    incomplete = {"reason": "max_output_tokens"} if finish_reason is FinishReason.LENGTH else None
    text_format = body.text_format
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": bool(body.background),
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "model": body.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": None,
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "store": body.store,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}
        },
        "tool_choice": _echoed_tool_choice(body),
        "tools": [_echoed_tool(tool) for tool in body.tools or []],
        "truncation": "disabled",
        "usage": usage_json(usage) if usage is not None else None,
        "user": body.user,
    }


def _echoed_tool_choice(body: ResponseCreateRequest) -> str | dict[str, Any]:
    return body.tool_choice if body.tool_choice is not None else "auto"  # OpenAI's default


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as ``FunctionTool`` reads it (``parameters`` and ``strict`` always present)."""
    return {"parameters": None, "strict": None, **tool}


def status_of(finish_reason: FinishReason | None) -> str:
    return "incomplete" if finish_reason is FinishReason.LENGTH else "completed"
