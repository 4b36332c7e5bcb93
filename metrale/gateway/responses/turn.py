"""One response being made: its ids, its response objects, and what is kept once it is done."""

from __future__ import annotations

import time
from typing import Any

from metrale.gateway.api.intake import Intake
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.gateway.responses.conversation import ResponsePrompt, seal, stop_text_of, transcript_after
from metrale.gateway.responses.items import item_id
from metrale.gateway.responses.objects import output_message, response_json, status_of
from metrale.gateway.responses.store import StoredResponse
from metrale.gateway.streams.choice import ChoiceDecoder
from metrale.shared.messages import Usage


class Turn:
    """One response being made: its request, prompt, input items and ids."""

    def __init__(self, intake: Intake[ResponseCreateRequest], prompt: ResponsePrompt, items: list[dict[str, Any]]):
        self.intake, self.prompt, self.items = intake, prompt, items
        self.response_id = intake.context.request_id
        self.message_id = item_id("msg")
        self.created_at = int(time.time())

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

    async def conclude(self, reply: ChoiceDecoder, usage: Usage) -> dict[str, Any]:
        """The finished response object; stored (and sealed) unless ``store`` is false."""
        status = status_of(reply.finish_reason)
        message = output_message(self.message_id, reply.text, status)
        body = self.body(status, [message], usage, finish_reason=reply.finish_reason)
        intake = self.intake
        gateway, tenant = intake.gateway, intake.context.tenant
        if not intake.body.store:
            await gateway.responses.mark_unstored(tenant, self.response_id)
            return body
        stop_text = stop_text_of(reply, intake.model.tokenizer)
        transcript = transcript_after(self.prompt, reply, stop_text)
        await seal(gateway, intake.context, intake.body.model, intake.model, transcript)
        messages = [*self.prompt.messages, {"role": "assistant", "content": reply.text}]
        rendered = self.prompt.rendered + reply.text
        stored = StoredResponse(body, self.items, messages, transcript, rendered, stop_text)
        await gateway.responses.save(tenant, stored)
        return body
