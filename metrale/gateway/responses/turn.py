"""One response being made: its ids, its output as the text arrives, and what is kept once it is done."""

from __future__ import annotations

from typing import Any

from metrale.gateway.api.answer.answer_parser import AnswerDelta, AnswerParser
from metrale.gateway.api.prepare.intake import Intake
from metrale.gateway.api.prepare.tools import ToolPlan
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.gateway.responses.conversation import (
    ResponsePrompt,
    rendered_through_reply,
    seal,
    stop_text_of,
    template_variables,
    transcript_after,
)
from metrale.gateway.responses.objects import response_json, status_of
from metrale.gateway.responses.output import OutputEvent, ResponseOutput
from metrale.gateway.responses.store import StoredResponse
from metrale.gateway.streams.choice import ChoiceDecoder
from metrale.shared.messages import Usage
from metrale.text.reasoning import ReasoningParser
from metrale.text.tool_calls.parser import ParsedDelta


class Turn:
    """One response being made: its request, prompt, input items, ids and output. The model's text
    goes through the reasoning parser (``reasoning_starts_inside`` not None: the model is read for
    reasoning, ``answer_parser.reasoning_start``), then the tool plan's parser (when tools are parsed),
    into ``output``."""

    def __init__(
        self,
        intake: Intake[ResponseCreateRequest],
        prompt: ResponsePrompt,
        items: list[dict[str, Any]],
        tools: ToolPlan,
        reasoning_starts_inside: bool | None = None,
    ) -> None:
        self.intake, self.prompt, self.items = intake, prompt, items
        self.response_id = intake.context.request_id
        self.created_at = int(intake.context.created_at)
        self.output = ResponseOutput(self.response_id)
        calls = tools.new_parser(self.response_id, 0)
        thinking = None if reasoning_starts_inside is None else ReasoningParser(starts_inside=reasoning_starts_inside)
        self._parser = AnswerParser(thinking, calls) if calls is not None or thinking is not None else None

    def body(
        self, status: str, output: list[dict[str, Any]], usage: Usage | None = None, **extra: Any
    ) -> dict[str, Any]:
        return response_json(
            response_id=self.response_id,
            created_at=self.created_at,
            body=self.intake.body,
            status=status,
            output=output,
            usage=usage,
            **extra,
        )

    def read(self, text: str) -> list[OutputEvent]:
        """The events of the next piece of the model's text."""
        answer = self._parser.push(text) if self._parser is not None else AnswerDelta("", ParsedDelta(content=text))
        return self._push(answer)

    def end(self, reply: ChoiceDecoder) -> list[OutputEvent]:
        """The events that close the output, once the model's text has all been read."""
        events = self._push(self._parser.finish()) if self._parser is not None else []
        return events + self.output.finish(status_of(reply.finish_reason))

    def _push(self, answer: AnswerDelta) -> list[OutputEvent]:
        return self.output.push(answer.parsed, answer.reasoning)

    async def conclude(self, reply: ChoiceDecoder, usage: Usage) -> dict[str, Any]:
        """The finished response object (after ``end``); stored (and sealed) unless ``store`` is false."""
        intake = self.intake
        gateway, tenant = intake.gateway, intake.context.tenant
        if not intake.body.store:
            await gateway.responses.mark_unstored(tenant, self.response_id)
            return self.finished_body(reply, usage)
        stored = await self.sealed(reply, usage)
        await gateway.responses.save(tenant, stored)
        return stored.body

    def finished_body(self, reply: ChoiceDecoder, usage: Usage) -> dict[str, Any]:
        """The finished response object (after ``end``)."""
        status = status_of(reply.finish_reason)
        return self.body(status, self.output.items, usage, finish_reason=reply.finish_reason)

    async def sealed(self, reply: ChoiceDecoder, usage: Usage) -> StoredResponse:
        """The finished response as it is stored, its final state sealed (``conversation.seal``) so a
        continuation resumes past its last token; not saved yet."""
        body = self.finished_body(reply, usage)
        intake = self.intake
        tokenizer = intake.model.tokenizer
        stop_text = stop_text_of(reply, tokenizer)
        transcript = transcript_after(self.prompt, reply, stop_text)
        await seal(intake.gateway, intake.context, intake.body.model, intake.model, transcript)
        assistant = self.output.assistant_message()
        extra = template_variables(intake.body)
        rendered = rendered_through_reply(tokenizer, self.prompt, assistant, reply.text, stop_text, extra)
        messages = [*self.prompt.messages, assistant]
        return StoredResponse(body, self.items, messages, transcript, rendered, stop_text)
