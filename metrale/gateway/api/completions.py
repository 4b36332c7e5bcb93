"""``POST /v1/completions``: a text (or token-id) prompt continued, answered whole or streamed."""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import APIRouter, Request
from starlette.responses import Response

from metrale.gateway.api.intake import Intake, fleet_place, take_in
from metrale.gateway.api.off_loop import build_stop_automaton, compiles_grammar, run_off_loop
from metrale.gateway.api.prompts import completion_prompt_ids
from metrale.gateway.api.sampling import RequestContext, build_submission, check_logprobs, require
from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.request_bodies import CompletionRequest
from metrale.gateway.request_limits import check_generate_work
from metrale.gateway.response_bodies import Completion, CompletionChoice, CompletionLogprobs, UsageInfo
from metrale.gateway.streams.choice import ChoiceDelta, merge_deltas
from metrale.gateway.streams.chunk_json import ChunkEnvelope, choice_json, json_text
from metrale.gateway.streams.delivery import Prepared, deliver
from metrale.gateway.streams.logprobs import LogprobFormatter
from metrale.shared.messages import Usage

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    """Create a text completion (OpenAI-compatible, with Metrale's extensions)."""
    intake = await take_in(request, CompletionRequest, "cmpl")
    async with fleet_place(intake):
        prepared = await prepare_completion(intake)
        body = intake.body
        return await deliver(intake.gateway, prepared, stream=body.stream, include_usage=body.include_usage)


async def prepare_completion(intake: Intake[CompletionRequest]) -> Prepared:
    """Everything the route checks and builds before it submits (also what a batch line goes through)."""
    prepared = await build_completion(intake.body, intake.context, intake.model)
    check_generate_work(prepared.submission.request, intake.gateway.settings.request_limits, param="max_tokens")
    return prepared


async def build_completion(body: CompletionRequest, context: RequestContext, model: ServedModel) -> Prepared:
    """``prepare_completion`` for a known model (also what ``met generate`` runs a batch line with)."""
    body.refuse_unsupported(body.n)
    require(not body.echo, "echo is not supported", "echo")
    check_logprobs(body.logprobs, "logprobs")
    prompt_ids = await completion_prompt_ids(model.tokenizer, body, max_model_len=model.max_model_len)
    submission = await run_off_loop(
        lambda: build_submission(
            body,
            context,
            model,
            prompt_ids=prompt_ids,
            budget=body.token_budget,
            logprobs=body.logprobs,
            prompt_param="prompt",
        ),
        inline=not compiles_grammar(body),  # a grammar is compiled off the loop
    )
    await build_stop_automaton(body.stop_strings)
    renderer = CompletionRenderer(
        request_id=context.request_id,
        model=body.model,
        fingerprint=model.announcement.fingerprint,
        n=body.n,
        logprobs=LogprobFormatter(model.tokenizer) if body.logprobs is not None else None,
    )
    return Prepared(submission, renderer)


class CompletionRenderer:
    """``text_completion`` objects (whole, and as stream chunks) for one request.

    Logprob ``text_offset`` s count characters from the start of each choice's text; the renderer
    keeps each choice's running offset across chunks.
    """

    def __init__(
        self, *, request_id: str, model: str, fingerprint: str, n: int, logprobs: LogprobFormatter | None
    ) -> None:
        self._id = request_id
        self._model = model
        self._fingerprint = f"met-{fingerprint[:12]}"
        self._n = n
        self._logprobs = logprobs
        self._offsets = [0] * n
        self._created = int(time.time())
        self._envelope = ChunkEnvelope(
            id=request_id,
            object="text_completion",
            created=self._created,
            model=model,
            system_fingerprint=self._fingerprint,
        )

    def opening_chunks(self) -> list[str]:
        return []

    def delta_chunk(self, delta: ChoiceDelta) -> str | None:
        logprobs = self._format_logprobs(delta)
        if not delta.text and delta.finish_reason is None and not (logprobs and logprobs.tokens):
            return None
        content = f'"text":{json_text(delta.text)}'
        return self._envelope.chunk(choice_json(delta.index, content, logprobs, delta.finish_reason))

    def usage_chunk(self, usage: Usage) -> str:
        return self._completion([], usage=UsageInfo.of(usage)).model_dump_json()

    def response(self, deltas: Sequence[ChoiceDelta], usage: Usage) -> Completion:
        choices = [self._choice(choice, self._format_logprobs(choice)) for choice in merge_deltas(deltas, self._n)]
        return self._completion(choices, usage=UsageInfo.of(usage))

    def _choice(self, delta: ChoiceDelta, logprobs: CompletionLogprobs | None) -> CompletionChoice:
        return CompletionChoice(
            index=delta.index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason
        )

    def _completion(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> Completion:
        return Completion(
            id=self._id,
            created=self._created,
            model=self._model,
            system_fingerprint=self._fingerprint,
            choices=choices,
            usage=usage,
        )

    def _format_logprobs(self, delta: ChoiceDelta) -> CompletionLogprobs | None:
        if self._logprobs is None or delta.logprobs is None:
            return None
        logprobs, self._offsets[delta.index] = self._logprobs.completion(
            delta.token_ids, delta.logprobs, delta.top_logprobs, self._offsets[delta.index]
        )
        return logprobs
