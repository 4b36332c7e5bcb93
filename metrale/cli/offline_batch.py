"""``met generate --input`` with OpenAI batch lines (``{"custom_id", "method": "POST", "url", "body"}``),
run in this process without Redis or HTTP, like ``vllm run-batch``.

Each line goes through the gateway's own code wherever no fleet is needed: the structural checks of
``POST /v1/batches`` (``batch/input_lines.py``), the endpoint's schema, prompt and sampling checks
(``build_completion`` / ``build_chat``), the worker's sampling parameters (``engine_request``), and the
endpoint's renderer fed the generated tokens one per event, as a worker streams them — so an output
line is what the online batch writes, ids and ``created`` aside. Sessions need a fleet and are ignored;
``cached_tokens`` is 0 (nothing is restored from a checkpoint here).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from metrale.batch.input_lines import BatchLine, read_lines
from metrale.batch.line_request import ENDPOINTS
from metrale.cli.generate_jobs import JobFileError
from metrale.gateway.api.chat import build_chat
from metrale.gateway.api.completions import build_completion
from metrale.gateway.api.prepare.prompts import chat_prompt
from metrale.gateway.api.prepare.sampling import RequestContext
from metrale.gateway.edge.body import invalid_body
from metrale.gateway.fleet.registry import ServedModel, build_tokenizer
from metrale.gateway.generation_defaults import sampling_defaults, with_sampling_defaults
from metrale.gateway.request_bodies import ChatCompletionRequest, CompletionRequest
from metrale.gateway.streams.choice import ChoiceDecoder, ChoiceDelta
from metrale.gateway.streams.delivery import Prepared
from metrale.shared.errors import BadRequest, MetraleError
from metrale.shared.messages import FinishReason, GenerateRequest, TokenEvent, Usage
from metrale.worker.engine.factory import LoadedModel
from metrale.worker.engine.request import Completion, GenerationResult
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.fleet.admission import SEED_LIMIT, engine_request
from metrale.worker.fleet.announcement import model_announcement
from metrale.worker.scheduler.sequence import FinishReason as EngineFinishReason

Schema = TypeVar("Schema", CompletionRequest, ChatCompletionRequest)

MAX_LISTED_ERRORS = 20
OFFLINE_WORKER = "offline"


@dataclass(frozen=True, slots=True)
class OfflineLine:
    """One line of the file, checked and ready: its request and the renderer of its answer."""

    line: BatchLine
    prepared: Prepared


def served_model(loaded: LoadedModel, name: str) -> ServedModel:
    """``loaded`` as a gateway sees the model a worker announces (the same tokenizer, limits, stop ids)."""
    announcement = model_announcement(loaded, name)
    return ServedModel(announcement, build_tokenizer(announcement))


def read_batch_file(path: Path, model: ServedModel) -> list[OfflineLine]:
    """Every line, checked as ``POST /v1/batches`` checks it; raises ``JobFileError`` naming each bad line."""
    endpoint = _endpoint(path)
    lines, errors = read_lines(path, endpoint)
    problems = [(error.line or 0, f"{error.code}: {error.message}") for error in errors]
    ready: list[OfflineLine] = []
    for line, outcome in zip(lines, asyncio.run(_prepare_all(lines, endpoint, model)), strict=True):
        if isinstance(outcome, MetraleError):
            problems.append((line.number, f"{outcome.code}: {outcome.message}"))
        else:
            ready.append(OfflineLine(line, outcome))
    if problems:
        listed = [f"{path}:{number}: {message}" for number, message in sorted(problems)[:MAX_LISTED_ERRORS]]
        more = len(problems) - len(listed)
        tail = [f"... and {more} more"] if more > 0 else []
        raise JobFileError("\n".join([f"{len(problems)} bad lines, nothing was run:", *listed, *tail]))
    if not ready:
        raise JobFileError(f"{path}: no requests in the file")
    return ready


def run_batch_file(
    loaded: LoadedModel,
    lines: Sequence[OfflineLine],
    *,
    seed: int | None,
    progress: Callable[[GenerationResult], None] | None = None,
) -> Iterator[str]:
    """Generate every line (all batched in the engine) and yield the output lines, in input order."""
    seeds = random.Random(seed)  # ``--seed``: lines without a seed draw theirs from it, reproducibly
    requests = [item.prepared.submission.request for item in lines]
    drawn = [r if r.seed is not None else replace(r, seed=seeds.randrange(SEED_LIMIT)) for r in requests]
    params: list[SamplingParams] = [engine_request(request).params for request in drawn]
    prompts = [request.prompt_token_ids for request in requests]
    results = loaded.engine.generate(prompts, params, progress=progress)
    for item, result in zip(lines, results, strict=True):
        refused = next((c.error for c in result.completions if c.finish_reason is EngineFinishReason.REFUSED), None)
        if refused is not None:  # as the gateway answers a worker's refusal
            yield output_line(item, BadRequest(f"The worker refused the request: {refused}").to_openai(), status=400)
        else:
            scores = item.prepared.submission.prompt_scores  # what a worker sends first, when asked
            if scores is not None:
                scores.logprobs += result.prompt_logprobs
                scores.top_logprobs += [list(top) for top in result.prompt_top_logprobs]
            yield output_line(item, answer_body(item.prepared, result.completions))


def answer_body(prepared: Prepared, completions: Sequence[Completion]) -> dict[str, Any]:
    """The endpoint's response body for these completions, rendered as the gateway renders a whole answer."""
    submission = prepared.submission
    request = submission.request
    stop_ids = set(request.stop_token_ids) | submission.model.stop_ids
    deltas: list[ChoiceDelta] = []
    completion_tokens = 0
    for index, completion in enumerate(completions):
        decoder = ChoiceDecoder(
            index,
            submission.model.tokenizer,
            request.prompt_token_ids,
            stop_strings=submission.stop_strings,
            stop_ids=stop_ids,
            skip_special_tokens=not submission.keeps_special_tokens,
        )
        for event in _events(request, index, completion):
            deltas.append(decoder.accept(event))
            if decoder.finished:
                break
        completion_tokens += decoder.completion_tokens
    usage = Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=completion_tokens, cached_tokens=0)
    body: dict[str, Any] = prepared.renderer.response(deltas, usage).model_dump(mode="json")
    return body


def output_line(item: OfflineLine, body: dict[str, Any], *, status: int = 200) -> str:
    """A line of the output file, as ``POST /v1/batches`` writes it."""
    request_id = item.prepared.submission.request.request_id
    response = {"status_code": status, "request_id": request_id, "body": body}
    line_id = f"batch_req_{uuid.uuid4().hex[:24]}"
    return json.dumps({"id": line_id, "custom_id": item.line.custom_id, "response": response, "error": None})


def _events(request: GenerateRequest, index: int, completion: Completion) -> Iterator[TokenEvent]:
    """The choice's tokens as a worker streams them: one event per token, usage on the last."""
    assert completion.token_ids and completion.finish_reason is not None, "the engine ran the choice to its end"
    count = len(completion.token_ids)
    for position, token in enumerate(completion.token_ids):
        last = position == count - 1
        top = None
        if request.logprobs:
            top = [[(int(t), float(lp)) for t, lp in completion.top_logprobs[position]]]
        yield TokenEvent(
            request_id=request.request_id,
            index=index,
            seq=position,
            token_ids=[token],
            worker_id=OFFLINE_WORKER,
            logprobs=[float(completion.logprobs[position])] if request.logprobs is not None else None,
            top_logprobs=top,
            finished=last,
            finish_reason=FinishReason(completion.finish_reason.value) if last else None,
            usage=Usage(len(request.prompt_token_ids), count, cached_tokens=0) if last else None,
        )


async def _prepare_all(lines: Sequence[BatchLine], endpoint: str, model: ServedModel) -> list[Prepared | MetraleError]:
    return [await _prepare(line, endpoint, model) for line in lines]


async def _prepare(line: BatchLine, endpoint: str, model: ServedModel) -> Prepared | MetraleError:
    """The line as its endpoint checks a request (``line_request.prepare_line`` without a fleet)."""
    try:
        now = time.time()
        context = RequestContext(
            request_id=f"{ENDPOINTS[endpoint].id_prefix}-{uuid.uuid4().hex}",
            tenant=OFFLINE_WORKER,
            session_id=None,
            deadline=now + 24 * 3600,
            created_at=now,
        )
        defaults = sampling_defaults(model.announcement.generation_config_json)
        if endpoint == "/v1/completions":
            completion = with_sampling_defaults(_parse(CompletionRequest, line), defaults)
            return await build_completion(completion, context, model)
        chat = with_sampling_defaults(_parse(ChatCompletionRequest, line), defaults)
        return build_chat(
            chat, context, model, await chat_prompt(model.tokenizer, chat, None, max_model_len=model.max_model_len)
        )
    except MetraleError as error:
        return error


def _parse(schema: type[Schema], line: BatchLine) -> Schema:
    try:
        return schema.model_validate_json(line.body_json)
    except ValidationError as error:
        raise invalid_body(error.errors(include_url=False)) from None


def _endpoint(path: Path) -> str:
    """The endpoint of the file: its first line's ``url``."""
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    url = None
                if url not in ENDPOINTS:
                    raise JobFileError(f"{path}:{number}: url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
                return str(url)
    raise JobFileError(f"{path}: no requests in the file")
