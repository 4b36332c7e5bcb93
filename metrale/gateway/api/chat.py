"""``POST /v1/chat/completions``: a chat rendered by the model's template, answered whole or streamed."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from fastapi import APIRouter, Request
from starlette.responses import Response

from metrale.gateway.api.intake import Intake, take_in
from metrale.gateway.api.prompts import ChatPrompt, chat_prompt
from metrale.gateway.api.sampling import RequestContext, build_submission, check_logprobs, require
from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.request_bodies import ChatCompletionRequest
from metrale.gateway.response_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    UsageInfo,
)
from metrale.gateway.state import Gateway
from metrale.gateway.streams.choice import ChoiceDecoder, ChoiceDelta, merge_deltas
from metrale.gateway.streams.chunk_json import ChunkEnvelope, choice_json, json_text
from metrale.gateway.streams.delivery import Prepared, deliver
from metrale.gateway.streams.logprobs import LogprobFormatter
from metrale.shared.messages import Usage
from metrale.shared.sessions import Transcript
from metrale.text.tokenizer import Tokenizer

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    """Create a chat completion (OpenAI-compatible, with Metrale's extensions)."""
    intake = await take_in(request, ChatCompletionRequest, "chatcmpl")
    prepared = await prepare_chat(intake)
    body = intake.body
    return await deliver(intake.gateway, prepared, stream=body.stream, include_usage=body.include_usage)


async def prepare_chat(intake: Intake[ChatCompletionRequest]) -> Prepared:
    """Everything the route checks and builds before it submits: the prompt, the ``Submission`` and its
    renderer (also what a batch line goes through)."""
    body, context = intake.body, intake.context
    body.refuse_unsupported()
    chat_logprobs_count(body)  # its errors come before the prompt's
    transcript = None
    if context.session_id is not None:
        transcript = await intake.gateway.sessions.transcript(context.tenant, context.session_id)
    prompt = await chat_prompt(
        intake.model.tokenizer,
        body,
        transcript,
        in_session=context.session_id is not None,
        max_model_len=intake.model.max_model_len,
    )
    on_complete = _transcript_writer(intake.gateway, context, prompt, intake.model.tokenizer)
    return build_chat(body, context, intake.model, prompt, on_complete=on_complete)


def build_chat(
    body: ChatCompletionRequest,
    context: RequestContext,
    model: ServedModel,
    prompt: ChatPrompt,
    *,
    on_complete: Callable[[ChoiceDecoder], Awaitable[None]] | None = None,
) -> Prepared:
    """The ``Submission`` and renderer of a rendered chat (also what ``met generate`` runs a batch line with)."""
    body.refuse_unsupported()
    logprobs = chat_logprobs_count(body)
    submission = build_submission(
        body,
        context,
        model,
        prompt_ids=prompt.token_ids,
        budget=body.token_budget,
        logprobs=logprobs,
        prompt_param="messages",
        checkpoint_positions=prompt.marks,
        on_complete=on_complete,
    )
    renderer = ChatRenderer(
        request_id=context.request_id,
        model=body.model,
        fingerprint=model.announcement.fingerprint,
        n=body.n,
        logprobs=LogprobFormatter(model.tokenizer) if logprobs is not None else None,
    )
    return Prepared(submission, renderer)


def _transcript_writer(
    gateway: Gateway, context: RequestContext, prompt: ChatPrompt, tokenizer: Tokenizer
) -> Callable[[ChoiceDecoder], Awaitable[None]] | None:
    """For a session: store prompt + reply once the reply is complete — the exact tokens, where the
    prompt ends, and the text as the client will render it back — for the next turn's checkpoint marks."""
    session_id = context.session_id
    if session_id is None:
        return None

    async def save(reply: ChoiceDecoder) -> None:
        stop = reply.hidden_stop_token
        stop_text = tokenizer.decode([stop], skip_special_tokens=False) if stop is not None else ""
        token_ids = (*prompt.token_ids, *reply.token_ids)
        transcript = Transcript(prompt.text + reply.text + stop_text, token_ids, len(prompt.token_ids))
        await gateway.sessions.save_transcript(context.tenant, session_id, transcript)

    return save


def chat_logprobs_count(body: ChatCompletionRequest) -> int | None:
    """How many alternatives the worker returns per token: None without ``logprobs``, else ``top_logprobs``."""
    check_logprobs(body.top_logprobs, "top_logprobs")
    asks_alternatives = body.top_logprobs is not None and body.top_logprobs > 0
    require(body.logprobs or not asks_alternatives, "top_logprobs requires logprobs to be true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


class ChatRenderer:
    """Chat completion objects and ``chat.completion.chunk`` s for one request."""

    def __init__(
        self, *, request_id: str, model: str, fingerprint: str, n: int, logprobs: LogprobFormatter | None
    ) -> None:
        self._id = request_id
        self._model = model
        self._fingerprint = f"met-{fingerprint[:12]}"
        self._n = n
        self._logprobs = logprobs
        self._created = int(time.time())
        self._envelope = ChunkEnvelope(
            id=request_id,
            object="chat.completion.chunk",
            created=self._created,
            model=model,
            system_fingerprint=self._fingerprint,
        )

    def opening_chunks(self) -> list[str]:
        """Each choice's first chunk names the assistant role."""
        opening = ChatDelta(role="assistant", content="")
        return [
            self._chunk(
                [ChatChunkChoice(index=index, delta=opening, logprobs=None, finish_reason=None)]
            ).model_dump_json()
            for index in range(self._n)
        ]

    def delta_chunk(self, delta: ChoiceDelta) -> str | None:
        logprobs = self._format_logprobs(delta)
        if not delta.text and delta.finish_reason is None and not (logprobs and logprobs.content):
            return None
        content = f'"delta":{{"content":{json_text(delta.text)}}}'
        return self._envelope.chunk(choice_json(delta.index, content, logprobs, delta.finish_reason))

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage=UsageInfo.of(usage)).model_dump_json()

    def response(self, deltas: Sequence[ChoiceDelta], usage: Usage) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=choice.index,
                message=AssistantMessage(content=choice.text),
                logprobs=self._format_logprobs(choice),
                finish_reason=choice.finish_reason,
            )
            for choice in merge_deltas(deltas, self._n)
        ]
        return ChatCompletion(
            id=self._id,
            created=self._created,
            model=self._model,
            system_fingerprint=self._fingerprint,
            choices=choices,
            usage=UsageInfo.of(usage),
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._id,
            created=self._created,
            model=self._model,
            system_fingerprint=self._fingerprint,
            choices=choices,
            usage=usage,
        )

    def _format_logprobs(self, delta: ChoiceDelta) -> ChatLogprobs | None:
        if self._logprobs is None or delta.logprobs is None:
            return None
        return self._logprobs.chat(delta.token_ids, delta.logprobs, delta.top_logprobs)
