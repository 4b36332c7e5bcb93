"""Prompts to token ids: chats through the model's chat template, completions as text or ids.

Long prompts are rendered and encoded in a worker thread so the event loop keeps serving streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from metrale.gateway.request_bodies import ChatCompletionRequest, CompletionRequest
from metrale.shared.errors import BadRequest
from metrale.shared.sessions import Transcript
from metrale.text.chat_template import ChatTemplateError
from metrale.text.tokenizer import Tokenizer

INLINE_PROMPT_CHARS = 10_000
"""Prompts up to this many characters are tokenized on the event loop (it takes well under 1 ms)."""

_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt"})

Result = TypeVar("Result")


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered chat: its text, its token ids, and the positions worth a checkpoint (the end of the
    system prompt, the end of the previous turn)."""

    text: str
    token_ids: list[int]
    marks: list[int] = field(default_factory=list)


async def chat_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest, transcript: Transcript | None) -> ChatPrompt:
    """The chat rendered by the model's template, with the assistant's turn opened; ``tools`` (checked
    by ``plan_tools``) are the template's ``tools``.

    With a ``transcript`` whose text the rendering extends, the ids are the transcript's exact ids
    followed by the new text's; otherwise the whole text is tokenized.
    """
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    extra = {
        name: value
        for name, value in (body.chat_template_kwargs or {}).items()
        if name not in _RESERVED_TEMPLATE_VARIABLES
    }
    if body.tools is not None:
        extra["tools"] = body.tools  # as the client wrote them, as transformers passes them
    size = sum(len(str(message.get("content") or "")) for message in messages)
    try:
        return await _run(lambda: _assemble(tokenizer, messages, extra, transcript), size)
    except ChatTemplateError as error:
        raise BadRequest(f"The chat cannot be rendered with this model's template: {error}", param="messages") from None


def _assemble(
    tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], extra: dict[str, Any], transcript: Transcript | None
) -> ChatPrompt:
    text = tokenizer.render_chat(messages, add_generation_prompt=True, **extra)
    marks: list[int] = []
    if transcript is not None and transcript.text and text.startswith(transcript.text):
        ids = [*transcript.token_ids, *tokenizer.encode(text[len(transcript.text) :])]
        marks.append(len(transcript.token_ids))
    else:
        ids = tokenizer.encode(text)
    if messages and messages[0].get("role") in ("system", "developer"):
        system = tokenizer.render_chat(messages[:1], add_generation_prompt=False, **extra)
        system_ids = tokenizer.encode(system) if text.startswith(system) else []
        if system_ids and ids[: len(system_ids)] == system_ids:
            marks.append(len(system_ids))
    return ChatPrompt(text, ids, sorted(m for m in set(marks) if 0 < m < len(ids)))


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
