"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes: what evaluation and agent frameworks
call to count and split text with the served model's own tokenizer (and chat template).

``/tokenize`` takes a ``prompt`` (special tokens added unless ``add_special_tokens`` is false, as a
completion's prompt is encoded) or ``messages`` (rendered by the chat template, the assistant's turn
opened unless ``add_generation_prompt`` is false; no special tokens added unless asked, as vLLM does)
and answers ``tokens``, ``count`` and ``max_model_len`` (and ``token_strs`` when asked). ``/detokenize``
turns ``tokens`` back into the ``prompt`` text. ``model`` may be left out while the fleet serves one
model. Authenticated like every other endpoint; long texts are encoded and decoded off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from metrale.gateway.api.prepare.prompts import INLINE_PROMPT_CHARS, encode_text
from metrale.gateway.api.prepare.sampling import require
from metrale.gateway.content_parts import check_template_kwargs, template_messages
from metrale.gateway.edge.body import parse_body
from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.request_bodies import ChatMessage
from metrale.gateway.state import Gateway, gateway_of
from metrale.shared.errors import BadRequest
from metrale.text.chat_templates.render import ChatTemplateError

router = APIRouter()

INLINE_DECODE_TOKENS = 4096
"""Token lists up to this long are decoded on the event loop."""


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(request: Request) -> TokenizeResponse:
    """Token ids of a prompt, or of a chat as the model's template renders it (vLLM's ``/tokenize``)."""
    gateway = gateway_of(request)
    gateway.auth.tenant_for(request.headers.get("authorization"))
    body = await parse_body(request, TokenizeRequest)
    require((body.prompt is None) != (body.messages is None), "send exactly one of prompt and messages", "prompt")
    model = await _model(gateway, body.model)
    tokenizer = model.tokenizer
    if body.prompt is not None:
        require(body.tools is None and body.chat_template_kwargs is None, "tools go with messages", "tools")
        add_special = body.add_special_tokens is not False
        ids = await encode_text(tokenizer, body.prompt, add_special_tokens=add_special)
    else:
        ids = await _chat_ids(gateway, body, model)
    strs = [tokenizer.decode([token], skip_special_tokens=False) for token in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(request: Request) -> DetokenizeResponse:
    """The text of token ids (vLLM's ``/detokenize``); special tokens' text included, as vLLM gives it."""
    gateway = gateway_of(request)
    gateway.auth.tenant_for(request.headers.get("authorization"))
    body = await parse_body(request, DetokenizeRequest)
    model = await _model(gateway, body.model)
    outside = [token for token in body.tokens if not 0 <= token < model.vocab_size]
    require(not outside, f"token ids {outside[:8]} are outside the vocabulary [0, {model.vocab_size})", "tokens")
    tokenizer = model.tokenizer
    if len(body.tokens) > INLINE_DECODE_TOKENS:
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
    else:
        text = tokenizer.decode(body.tokens, skip_special_tokens=False)
    return DetokenizeResponse(prompt=text)


async def _model(gateway: Gateway, name: str | None) -> ServedModel:
    """The model named, or the only one the fleet serves when none is named."""
    if name is None:
        served = await gateway.registry.live_model_names()
        if len(served) != 1:
            raise BadRequest(f"name the model: the fleet serves {len(served)} ({', '.join(served)})", param="model")
        name = served[0]
    return await gateway.registry.resolve(name)


async def _chat_ids(gateway: Gateway, body: TokenizeRequest, model: ServedModel) -> list[int]:
    """The chat rendered by the template (within the request limits on messages), then encoded."""
    messages = body.messages or []
    limit = gateway.settings.request_limits.max_messages
    require(len(messages) <= limit, f"messages may hold at most {limit} (MET_MAX_MESSAGES) messages", "messages")
    extra = check_template_kwargs(body.chat_template_kwargs)
    if body.tools is not None:
        require(len(body.tools) <= gateway.settings.request_limits.max_tools, "too many tools (MET_MAX_TOOLS)", "tools")
        extra["tools"] = body.tools
    dumped = template_messages(messages)
    tokenizer = model.tokenizer

    def render() -> str:
        try:
            return tokenizer.render_chat(dumped, add_generation_prompt=body.add_generation_prompt, **extra)
        except ChatTemplateError as error:
            raise BadRequest(
                f"The chat cannot be rendered with this model's template: {error}", param="messages"
            ) from None

    size = sum(len(str(message.get("content") or "")) for message in dumped)
    text = render() if size <= INLINE_PROMPT_CHARS and body.tools is None else await asyncio.to_thread(render)
    return await encode_text(tokenizer, text, add_special_tokens=body.add_special_tokens is True)
