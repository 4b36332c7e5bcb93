"""``POST /v1/chat/completions``: a chat rendered by the model's template, answered whole or streamed."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from fastapi import APIRouter, Request
from starlette.responses import Response

from metrale.gateway.api.answer.answer_parser import AnswerParser, reasoning_start
from metrale.gateway.api.answer.tool_call_output import assistant_message, chat_delta, finish_reason
from metrale.gateway.api.prepare.intake import Intake, fleet_place, take_in
from metrale.gateway.api.prepare.off_loop import build_stop_automaton, compiles_grammar, run_off_loop
from metrale.gateway.api.prepare.prompts import ChatPrompt, chat_prompt
from metrale.gateway.api.prepare.sampling import (
    RequestContext,
    build_submission,
    check_logprobs,
    check_prompt_logprobs,
    require,
)
from metrale.gateway.api.prepare.tools import NO_TOOLS, ToolPlan, plan_tools
from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.request_bodies import ChatCompletionRequest
from metrale.gateway.request_limits import check_generate_work
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
from metrale.gateway.streams.logprobs import LogprobFormatter, PromptLogprobsRequest
from metrale.shared.messages import Usage
from metrale.shared.sessions import Transcript
from metrale.text.reasoning import ReasoningParser
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.parser import fold_deltas

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    """Create a chat completion (OpenAI-compatible, with Metrale's extensions)."""
    intake = await take_in(request, ChatCompletionRequest, "chatcmpl")
    async with fleet_place(intake):
        prepared = await prepare_chat(intake)
        body = intake.body
        return await deliver(intake.gateway, prepared, stream=body.stream, include_usage=body.include_usage)


async def prepare_chat(intake: Intake[ChatCompletionRequest]) -> Prepared:
    """Everything the route checks and builds before it submits: the prompt, the ``Submission`` and its
    renderer (also what a batch line goes through). Tools are planned, a grammar compiled and the
    prompt rendered off the event loop (``off_loop.py``)."""
    body, context = intake.body, intake.context
    body.refuse_unsupported()
    chat_logprobs_count(body)  # its errors come before the prompt's
    parser_name = intake.gateway.settings.tool_call_parser
    tools = await run_off_loop(lambda: plan_tools(body, intake.model.tokenizer, parser_name), inline=body.tools is None)
    transcript = None
    if context.session_id is not None:
        transcript = await intake.gateway.sessions.transcript(context.tenant, context.session_id)
    prompt = await chat_prompt(
        intake.model.tokenizer,
        body,
        transcript,
        in_session=context.session_id is not None,
        max_model_len=intake.model.max_model_len,
        tool_call_parser=parser_name,
    )
    on_complete = _transcript_writer(intake.gateway, context, prompt, intake.model.tokenizer)
    prepared = await run_off_loop(
        lambda: build_chat(
            body,
            context,
            intake.model,
            prompt,
            on_complete=on_complete,
            tools=tools,
            reasoning_parser=intake.gateway.settings.reasoning_parser,
        ),
        inline=not compiles_grammar(body, tools.grammar),
    )
    await build_stop_automaton(body.stop_strings)
    budget_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    check_generate_work(prepared.submission.request, intake.gateway.settings.request_limits, param=budget_param)
    return prepared


def build_chat(
    body: ChatCompletionRequest,
    context: RequestContext,
    model: ServedModel,
    prompt: ChatPrompt,
    *,
    on_complete: Callable[[ChoiceDecoder], Awaitable[None]] | None = None,
    tools: ToolPlan | None = None,
    reasoning_parser: str | None = None,
) -> Prepared:
    """The ``Submission`` and renderer of a rendered chat (also what ``met generate`` runs a batch line with).

    ``tools`` is the request's ``plan_tools``; without it the tools are planned here, in the format the
    chat template implies. ``reasoning_parser`` (``--reasoning-parser``) reads the answer's reasoning
    apart; without it, a model whose template writes think blocks is read so too."""
    body.refuse_unsupported()
    logprobs = chat_logprobs_count(body)
    check_prompt_logprobs(body.prompt_logprobs, stream=body.stream)
    if tools is None:
        tools = plan_tools(body, model.tokenizer)
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
        tool_grammar=tools.grammar,
        tool_param=tools.grammar_param,
        keeps_special_tokens=tools.tool_format is not None and tools.tool_format.keeps_special_tokens,
        prompt_logprobs=body.prompt_logprobs,
    )
    wants_formatter = logprobs is not None or body.prompt_logprobs is not None
    renderer = ChatRenderer(
        request_id=context.request_id,
        model=body.model,
        fingerprint=model.announcement.fingerprint,
        n=body.n,
        logprobs=LogprobFormatter(model.tokenizer) if wants_formatter else None,
        prompt_logprobs=PromptLogprobsRequest.of(submission, body.prompt_logprobs),
        tools=tools,
        reasoning_starts_inside=reasoning_start(
            reasoning_parser,
            model.tokenizer.chat_template,
            prompt.text,
            constrained=submission.request.grammar is not None,
        ),
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
    """Chat completion objects and ``chat.completion.chunk`` s for one request. With ``tools`` that
    parse the output, each choice's text goes through its own parser (``message.tool_calls``, streamed
    ``delta.tool_calls``); a whole answer is parsed in one piece, which gives what a stream adds up to.
    With ``reasoning_starts_inside`` (not None: the model is read for reasoning; ``answer_parser.py``)
    the reasoning comes apart first, as ``reasoning_content``."""

    def __init__(
        self,
        *,
        request_id: str,
        model: str,
        fingerprint: str,
        n: int,
        logprobs: LogprobFormatter | None,
        tools: ToolPlan = NO_TOOLS,
        reasoning_starts_inside: bool | None = None,
        prompt_logprobs: PromptLogprobsRequest | None = None,
    ) -> None:
        self._id = request_id
        self._prompt_logprobs = prompt_logprobs
        self._tools = tools
        self._reasoning = reasoning_starts_inside
        self._parsers = [self._new_parser(index) for index in range(n)]
        self._called = [False] * n
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
        parser = self._parsers[delta.index]
        if parser is not None:
            return self._parsed_chunk(parser, delta, logprobs)
        if not delta.text and delta.finish_reason is None and not (logprobs and logprobs.content):
            return None
        content = f'"delta":{{"content":{json_text(delta.text)}}}'
        return self._envelope.chunk(choice_json(delta.index, content, logprobs, delta.finish_reason))

    def _new_parser(self, index: int) -> AnswerParser | None:
        """One choice's parser: reasoning (if read), then tool calls (if parsed); None for neither."""
        tools = self._tools.new_parser(self._id, index)
        if tools is None and self._reasoning is None:
            return None
        reasoning = None if self._reasoning is None else ReasoningParser(starts_inside=self._reasoning)
        return AnswerParser(reasoning, tools)

    def _parsed_chunk(self, parser: AnswerParser, delta: ChoiceDelta, logprobs: ChatLogprobs | None) -> str | None:
        answer = parser.push(delta.text)
        if delta.finish_reason is not None:
            answer.extend(parser.finish())
        parsed = answer.parsed
        self._called[delta.index] |= bool(parsed.calls)
        reason = finish_reason(delta.finish_reason, self._called[delta.index], parsed.cut_off)
        if answer.empty and reason is None and not (logprobs and logprobs.content):
            return None
        content = f'"delta":{chat_delta(parsed, answer.reasoning).model_dump_json()}'
        return self._envelope.chunk(choice_json(delta.index, content, logprobs, reason))

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage=UsageInfo.of(usage)).model_dump_json()

    def response(self, deltas: Sequence[ChoiceDelta], usage: Usage) -> ChatCompletion:
        choices = [self._choice(choice) for choice in merge_deltas(deltas, self._n)]
        return ChatCompletion(
            id=self._id,
            created=self._created,
            model=self._model,
            system_fingerprint=self._fingerprint,
            choices=choices,
            usage=UsageInfo.of(usage),
            prompt_logprobs=self._prompt_logprobs.render(self._logprobs) if self._prompt_logprobs else None,
        )

    def _choice(self, choice: ChoiceDelta) -> ChatChoice:
        logprobs = self._format_logprobs(choice)
        parser = self._new_parser(choice.index)
        if parser is None:
            message = AssistantMessage(content=choice.text)
            reason = None if choice.finish_reason is None else choice.finish_reason.value
            return ChatChoice(index=choice.index, message=message, logprobs=logprobs, finish_reason=reason)
        answer = parser.read_whole(choice.text)
        content, calls = fold_deltas([answer.parsed])
        reason = finish_reason(choice.finish_reason, bool(calls), answer.parsed.cut_off)
        reasoning = answer.reasoning if self._reasoning is not None else None
        message = assistant_message(content, calls, reasoning)
        return ChatChoice(index=choice.index, message=message, logprobs=logprobs, finish_reason=reason)

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
