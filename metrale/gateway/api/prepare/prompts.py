"""Prompts to token ids: chats through the model's chat template, completions as text or ids.

Before any rendering or tokenizing, a prompt whose characters cannot fit the context is refused
(``PromptTooLong``): a token covers at most ``tokenizer.max_chars_per_token`` characters
(``text/prompt_bound.py``), so ``c`` characters need at least ``ceil(c / L)`` tokens. A chat counts the
text of its messages' contents (a chat template renders every message's content, and adds to it).
Long prompts, chats of many messages and chats with tools are rendered and encoded in a worker thread,
through the tokenizer's GIL-releasing batch call, so the event loop keeps serving streams and probes
meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from metrale.gateway.content_parts import check_template_kwargs, template_messages
from metrale.gateway.request_bodies import ChatCompletionRequest
from metrale.shared.errors import BadRequest, PromptTooLong
from metrale.shared.sessions import Transcript
from metrale.text.chat_templates.render import ChatTemplateError
from metrale.text.prompt_bound import min_tokens_for
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import format_for_template, format_named

INLINE_PROMPT_CHARS = 10_000
"""Prompts up to this many characters are tokenized on the event loop (it takes well under 1 ms)."""

INLINE_MESSAGES = 64
"""Chats of up to this many messages, without ``tools``, are rendered on the event loop; longer ones, and
any with tools (rendered as JSON by the template, up to ``MET_MAX_TOOLS`` of them), in a thread."""

Result = TypeVar("Result")


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered chat: its text, its token ids, and the positions worth a checkpoint (the end of the
    system prompt, the end of the previous turn)."""

    text: str
    token_ids: list[int]
    marks: list[int] = field(default_factory=list)


async def chat_prompt(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    transcript: Transcript | None,
    *,
    in_session: bool = False,
    max_model_len: int | None = None,
    tool_call_parser: str | None = None,
) -> ChatPrompt:
    """The chat rendered by the model's template, with the assistant's turn opened, tokenized whole;
    ``tools`` (checked by ``plan_tools``) are the template's ``tools``.

    A session only adds checkpoint marks: the ids are always the tokenization of the rendered text, so
    a session never changes an answer. In a session (``transcript``: its last turn, None for the first) the
    prompt's end and its settled length are marked (their states are kept for the next turn), and so are
    the previous turn's where the new tokenization agrees with them, and its reply's end. With
    ``max_model_len``, a chat whose contents cannot fit it is refused first, before rendering. Earlier
    calls reach a template whose format reads their ``arguments`` as a mapping (the format
    ``tool_call_parser`` names, else the template's) as one (``mapping_arguments``).
    """
    messages = template_messages(body.messages)
    tool_format = format_named(tool_call_parser) if tool_call_parser else format_for_template(tokenizer.chat_template)
    if tool_format is not None and tool_format.arguments_as_mapping:
        messages = mapping_arguments(messages)
    extra = check_template_kwargs(body.chat_template_kwargs)
    if max_model_len is not None:
        chars = sum(_content_chars(message.content) for message in body.messages)
        refuse_unfitting_chars(tokenizer, chars, max_model_len, param="messages")
    if body.tools is not None:
        extra["tools"] = body.tools  # as the client wrote them, as transformers passes them
    size = sum(len(str(message.get("content") or "")) for message in messages)
    inline = size <= INLINE_PROMPT_CHARS and body.tools is None and len(messages) <= INLINE_MESSAGES
    try:
        return await _run(lambda: _assemble(tokenizer, messages, extra, transcript, in_session), inline)
    except ChatTemplateError as error:
        raise BadRequest(f"The chat cannot be rendered with this model's template: {error}", param="messages") from None


def mapping_arguments(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each assistant call's ``arguments`` JSON text read into the object it holds
    (HF templates iterate ``arguments|items``); 400 naming an argument text that is not a JSON object."""
    converted = []
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if isinstance(calls, list):
            message = {
                **message,
                "tool_calls": [
                    _mapped_call(call, f"messages[{index}].tool_calls[{at}]") for at, call in enumerate(calls)
                ],
            }
        converted.append(message)
    return converted


def _mapped_call(call: Any, where: str) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    arguments = function["arguments"]
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON object", param=f"{where}.function.arguments")
    return {**call, "function": {**function, "arguments": value}}


def render_messages(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], extra: dict[str, Any]) -> str:
    """The chat's text with the assistant's turn opened; ``BadRequest`` when the template fails."""
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=True, **extra)
    except ChatTemplateError as error:
        raise BadRequest(f"The chat cannot be rendered with this model's template: {error}", param="input") from None


def _assemble(
    tokenizer: Tokenizer,
    messages: Sequence[dict[str, Any]],
    extra: dict[str, Any],
    transcript: Transcript | None,
    in_session: bool,
) -> ChatPrompt:
    text = tokenizer.render_chat(messages, add_generation_prompt=True, **extra)
    encode = tokenizer.encode_releasing_gil if len(text) > INLINE_PROMPT_CHARS else tokenizer.encode
    ids = encode(text)
    marks: list[int] = []
    special = tokenizer.special_token_ids
    if transcript is not None:
        marks += session_marks(ids, transcript, special)
    if in_session:
        marks.append(settled_length(ids, special))
    if messages and messages[0].get("role") in ("system", "developer"):
        system = tokenizer.render_chat(messages[:1], add_generation_prompt=False, **extra)
        system_ids = tokenizer.encode(system) if text.startswith(system) else []
        if system_ids and ids[: len(system_ids)] == system_ids:
            marks.append(len(system_ids))
    inside = sorted(m for m in set(marks) if 0 < m < len(ids))
    return ChatPrompt(text, ids, [*inside, len(ids)] if in_session else inside)


def settled_length(ids: Sequence[int], special_ids: Collection[int]) -> int:
    """How many leading ``ids`` no following text can change: up to the last special token (text is
    split at special tokens before it is tokenized). A prompt ending in ``assistant\n`` can have its
    ``\n`` merged with the reply's first characters when the history is tokenized again."""
    return next((at + 1 for at in range(len(ids) - 1, -1, -1) if ids[at] in special_ids), 0)


def session_marks(ids: Sequence[int], transcript: Transcript, special_ids: Collection[int]) -> list[int]:
    """Where the previous turn's checkpoints lie in ``ids``, if its tokens are a prefix there: its
    prompt's end and settled length (both checkpointed), and the end of its reply (all but the reply's
    last token, which the reply's final state has not consumed) — the latter only when the reply
    re-tokenized to the tokens generated."""
    previous = transcript.token_ids
    prompt = previous[: transcript.prompt_length]
    marks = []
    for length in (settled_length(prompt, special_ids), len(prompt), len(previous) - 1):
        if 0 < length < len(ids) and tuple(ids[:length]) == previous[:length]:
            marks.append(length)
    return marks


def refuse_unfitting_chars(tokenizer: Tokenizer, chars: int, max_model_len: int, *, param: str) -> None:
    """Raise ``PromptTooLong`` when ``chars`` characters need at least ``max_model_len`` tokens (the
    context would hold no generated token)."""
    per_token = tokenizer.max_chars_per_token
    if per_token is None:
        return
    fewest = min_tokens_for(chars, per_token)
    if fewest >= max_model_len:
        raise PromptTooLong(max_model_len, fewest, param=param)


def _content_chars(content: str | list[dict[str, Any]] | None) -> int:
    """Characters of a message's text: its string, or the ``text`` of its parts."""
    if isinstance(content, str):
        return len(content)
    if content is None:
        return 0
    return sum(len(part["text"]) for part in content if isinstance(part.get("text"), str))


async def completion_prompt_ids(
    tokenizer: Tokenizer, prompt: str | list[int], *, max_model_len: int | None = None
) -> list[int]:
    """One completion prompt's token ids: given as ids, or the text encoded with the tokenizer's
    special tokens.

    With ``max_model_len``, a prompt that cannot fit it is refused before it is encoded."""
    if isinstance(prompt, list):
        if max_model_len is not None and len(prompt) >= max_model_len:
            raise PromptTooLong(max_model_len, len(prompt), param="prompt")
        return [int(item) for item in prompt]
    if max_model_len is not None:
        refuse_unfitting_chars(tokenizer, len(prompt), max_model_len, param="prompt")
    return await encode_text(tokenizer, prompt)


async def encode_text(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Completions encode like ``transformers``' tokenizer call: special tokens (BOS) added; long
    texts in a worker thread."""
    if len(text) > INLINE_PROMPT_CHARS:
        return await asyncio.to_thread(tokenizer.encode_releasing_gil, text, add_special_tokens=add_special_tokens)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def _run(work: Callable[[], Result], inline: bool) -> Result:
    return work() if inline else await asyncio.to_thread(work)
