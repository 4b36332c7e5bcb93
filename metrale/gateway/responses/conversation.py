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

from metrale.gateway.api.prompts import render_messages
from metrale.gateway.api.sampling import RequestContext
from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.gateway.responses.items import chat_messages
from metrale.gateway.responses.store import StoredResponse
from metrale.gateway.state import Gateway
from metrale.gateway.streams.choice import ChoiceDecoder
from metrale.gateway.streams.generation import start_generation
from metrale.gateway.streams.submission import Submission
from metrale.shared.errors import BadRequest, MetraleError
from metrale.shared.messages import GenerateRequest, Priority
from metrale.shared.sessions import Transcript
from metrale.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResponsePrompt:
    """The conversation's text and token ids up to the opened assistant turn, the positions worth
    resuming from, and the conversation as chat messages."""

    text: str
    token_ids: list[int]
    marks: list[int]
    messages: list[dict[str, str]]
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
    if previous is None:
        text = render_messages(tokenizer, new, {})
        return ResponsePrompt(text, tokenizer.encode(text), [], new, text)
    messages = [*previous.messages, *new]
    rendered = render_messages(tokenizer, messages, {})
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
