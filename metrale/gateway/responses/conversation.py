"""A response's prompt: a new conversation tokenized whole, or a continuation fed the previous
response's exact tokens; and sealing a stored response so its next turn resumes past its last token.

A continuation's ids are the previous transcript (prompt plus reply as generated) followed by the new
text the chat template adds after the reply's content (less the template's end of turn when the reply's
stop token was that text) — never a fresh tokenization of the history, so the model sees exactly the
tokens it produced, and the previous response's checkpoint is always a prefix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from metrale.gateway.api.prepare.prompts import mapping_arguments, render_messages
from metrale.gateway.api.prepare.sampling import RequestContext
from metrale.gateway.content_parts import check_template_kwargs
from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.gateway.responses.items import chat_messages
from metrale.gateway.responses.store import StoredResponse
from metrale.gateway.responses.tools import chat_tools
from metrale.gateway.state import Gateway
from metrale.gateway.streams.choice import ChoiceDecoder
from metrale.gateway.streams.generation import start_generation
from metrale.gateway.streams.submission import Submission
from metrale.shared.errors import BadRequest, MetraleError
from metrale.shared.messages import GenerateRequest, Priority
from metrale.shared.sessions import Transcript
from metrale.text.chat_templates.render import ChatTemplateError
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import format_for_template

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResponsePrompt:
    """The conversation's text and token ids up to the opened assistant turn, the positions worth
    resuming from, and the conversation as chat messages."""

    text: str
    token_ids: list[int]
    marks: list[int]
    messages: list[dict[str, Any]]
    rendered: str
    """The conversation as the chat template renders it (``text`` differs where a reply's stop token
    was not the template's end of turn: the exact tokens keep both)."""


def response_prompt(
    tokenizer: Tokenizer, body: ResponseCreateRequest, items: list[dict[str, Any]], previous: StoredResponse | None
) -> ResponsePrompt:
    """The prompt of a response to ``items`` (after ``previous``, when it continues one).

    ``instructions`` open a new conversation as its system message; in a continuation they come as a
    system message before the new input (the previous instructions are already in its tokens)."""
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    new = [*instructions, *chat_messages(items)]
    extra = template_variables(body)
    if previous is None:
        text = render_messages(tokenizer, template_ready(tokenizer, new), extra)
        return ResponsePrompt(text, tokenizer.encode(text), [], new, text)
    messages = [*previous.messages, *new]
    rendered = render_messages(tokenizer, template_ready(tokenizer, messages), extra)
    if not rendered.startswith(previous.rendered):
        raise BadRequest(
            "This model's chat template renders the earlier turns differently once the conversation grows, so "
            "the response cannot be continued from its exact tokens: send the whole conversation as input.",
            param="previous_response_id",
        )
    new_text = rendered[len(previous.rendered) :]
    if previous.stop_text and new_text.startswith(previous.stop_text):
        new_text = new_text[len(previous.stop_text) :]  # the template's end of turn: the stop token already
    before = previous.transcript
    ids = [*before.token_ids, *tokenizer.encode(new_text)]
    consumed = len(before.token_ids)
    return ResponsePrompt(before.text + new_text, ids, [consumed - 1, consumed], messages, rendered)


def template_ready(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as the chat template reads them: earlier calls' ``arguments`` as mappings where the
    template's call format iterates them (``prompts.mapping_arguments``, as chat does); the messages
    kept keep the JSON text."""
    tool_format = format_for_template(tokenizer.chat_template)
    return mapping_arguments(messages) if tool_format is not None and tool_format.arguments_as_mapping else messages


def template_variables(body: ResponseCreateRequest) -> dict[str, Any]:
    """The chat template's variables besides the messages: ``chat_template_kwargs`` (checked as on
    chat: 400 naming a key the server fills) and the request's function tools, in chat's shape (the
    template renders them whatever ``tool_choice`` says, as on chat)."""
    extra = check_template_kwargs(body.chat_template_kwargs)
    tools = chat_tools(body.tools)
    return {**extra, "tools": tools} if tools is not None else extra


def rendered_through_reply(
    tokenizer: Tokenizer,
    prompt: ResponsePrompt,
    assistant: dict[str, Any],
    shown: str,
    stop_text: str,
    extra: dict[str, Any],
) -> str:
    """The conversation as the template renders it, up to where the reply's stop token stands.

    A plain reply is rendered as written (``shown``, its text). A reply with tool calls is rendered by
    the template from the calls, which need not be the text generated (spacing, key order): its turn
    is the template's own, cut before the stop token's text, so the next turn's rendering extends it.
    Where that cannot be found, the reply's text is used (and a continuation whose rendering then
    differs is refused with a clear 400)."""
    plain = prompt.rendered + shown
    if not assistant.get("tool_calls") or not stop_text:
        return plain
    try:
        messages = template_ready(tokenizer, [*prompt.messages, assistant])
        whole = tokenizer.render_chat(messages, add_generation_prompt=False, **extra)
    except (ChatTemplateError, BadRequest):
        return plain
    turn = whole[len(prompt.rendered) :] if whole.startswith(prompt.rendered) else ""
    if stop_text not in turn:
        return plain
    return prompt.rendered + turn[: turn.rindex(stop_text)]


def stop_text_of(reply: ChoiceDecoder, tokenizer: Tokenizer) -> str:
    """The text of the hidden stop token that ended ``reply`` ("" when none did)."""
    stop = reply.hidden_stop_token
    return tokenizer.decode([stop], skip_special_tokens=False) if stop is not None else ""


def transcript_after(prompt: ResponsePrompt, reply: ChoiceDecoder, stop_text: str) -> Transcript:
    """Prompt plus reply exactly as generated (stop token included), and their text (the reply as
    shown, then the hidden stop token's text)."""
    token_ids = (*prompt.token_ids, *reply.token_ids)
    return Transcript(prompt.text + reply.text + stop_text, token_ids, len(prompt.token_ids))


async def seal(
    gateway: Gateway, context: RequestContext, model_name: str, model: ServedModel, transcript: Transcript
) -> None:
    """Have a worker consume the reply's last token too, so the next turn resumes from the whole
    transcript (a finished request's state never holds its last sampled token).

    One-token request fed the transcript: it resumes from the reply's final checkpoint (one token
    short) and leaves its own final checkpoint, covering every token, stored before it ends. A failure
    only costs the next turn one token of prefill."""
    ids = list(transcript.token_ids)
    if len(ids) + 1 > model.max_model_len:
        return
    request = GenerateRequest(
        request_id=f"{context.request_id}-seal",
        model=model_name,
        tenant=context.tenant,
        prompt_token_ids=ids,
        max_tokens=1,
        temperature=0.0,
        priority=Priority.INTERACTIVE,
        checkpoint_positions=[len(ids) - 1],
        deadline=context.deadline,
        created_at=context.created_at,
        live_events=False,
        keep_final_state=True,
    )
    submission = Submission(request, model, ())
    opened = start_generation(submission, relay=gateway.relay, dispatcher=gateway.dispatcher, metrics=gateway.metrics)
    try:
        async with opened as generation:
            async for _ in generation.deltas():
                pass
    except MetraleError as error:
        logger.warning("response %s not sealed: %s", context.request_id, error)
