"""Prompts to token ids: chats through the model's chat template, completions as text or ids.

Long prompts are rendered and encoded in a worker thread so the event loop keeps serving streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from metrale.gateway.schemas import ChatCompletionRequest, CompletionRequest
from metrale.shared.errors import BadRequest
from metrale.text.chat_template import ChatTemplateError
from metrale.text.tokenizer import Tokenizer

INLINE_PROMPT_CHARS = 10_000
"""Prompts up to this many characters are tokenized on the event loop (it takes well under 1 ms)."""

_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt"})

Result = TypeVar("Result")


async def chat_prompt_ids(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The chat rendered by the model's template, with the assistant's turn opened, as token ids."""
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    extra = {
        name: value
        for name, value in (body.chat_template_kwargs or {}).items()
        if name not in _RESERVED_TEMPLATE_VARIABLES
    }

    def render() -> list[int]:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)

    size = sum(len(str(message.get("content") or "")) for message in messages)
    try:
        return await _run(render, size)
    except ChatTemplateError as error:
        raise BadRequest(f"The chat cannot be rendered with this model's template: {error}", param="messages") from None


async def completion_prompt_ids(tokenizer: Tokenizer, body: CompletionRequest) -> list[int]:
    """The prompt's token ids: given as ids, or the text encoded with the tokenizer's special tokens."""
    prompt = body.prompt
    if isinstance(prompt, list) and all(isinstance(item, int) for item in prompt):
        return [int(item) for item in prompt]
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequest(
                f"A list of {len(prompt)} prompts is not supported: send one prompt per request.", param="prompt"
            )
        return await _encode(tokenizer, str(prompt[0]))
    return await _encode(tokenizer, str(prompt))


async def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Completions encode like ``transformers``' tokenizer call: special tokens (BOS) added."""
    return await _run(lambda: tokenizer.encode(text, add_special_tokens=True), len(text))


async def _run(work: Callable[[], Result], size: int) -> Result:
    return await asyncio.to_thread(work) if size > INLINE_PROMPT_CHARS else work()
