"""Taking a request into the engine: a new one, or one some worker took before — continued from its
record, or given up when it cannot continue exactly or kept losing its workers."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from metrale.shared.messages import FinishReason, GenerateRequest, ModelAnnouncement
from metrale.shared.record import RunRecord
from metrale.shared.settings import WorkerSettings
from metrale.worker.checkpoints.writer import CheckpointWriter
from metrale.worker.engine.engine import Engine
from metrale.worker.fleet.admission import (
    Continuation,
    continuation,
    engine_request,
    refusal,
    resume_point,
    undeliverable,
)
from metrale.worker.fleet.failover_counters import FailoverCounters
from metrale.worker.fleet.tracker import RequestTracker
from metrale.worker.fleet.transport import Redelivery, StartedRequest

logger = logging.getLogger(__name__)

Taken = GenerateRequest | Redelivery
"""A request as the transport hands it over."""


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a request ends at once with an error event: ``REFUSED`` when the request cannot run as asked,
    ``ERROR`` when the fleet failed it (lost too often, or cannot continue it); ``dead_letter``: its entry
    is set aside too."""

    reason: str
    finish_reason: FinishReason = FinishReason.REFUSED
    dead_letter: bool = False


def tracker_for(item: Taken, worker_id: str, *, stream_interval: int = 1) -> RequestTracker:
    """The tracker of a request taken here: fresh, or picking up where its record ends."""
    if isinstance(item, GenerateRequest):
        return RequestTracker(item, worker_id, stream_interval=stream_interval)
    record = item.record or RunRecord(item.request_id, None, None, None, None, ())
    return RequestTracker.continuing(item.request, worker_id, record, stream_interval=stream_interval)


class Intake:
    """Adds taken requests to ``engine``, from the newest checkpoint of what they already consumed,
    counting continued ones in ``counters``."""

    def __init__(
        self,
        engine: Engine,
        model: ModelAnnouncement,
        settings: WorkerSettings,
        checkpoints: CheckpointWriter | None,
        counters: FailoverCounters,
    ) -> None:
        self._engine = engine
        self._model = model
        self._settings = settings
        self._checkpoints = checkpoints
        self._counters = counters

    def start(self, item: Taken, tracker: RequestTracker) -> StartedRequest | Refused:
        """Run ``item`` in the engine and say what its record must name, or why it ends at once."""
        if isinstance(item, GenerateRequest):
            return self._run(item, tracker, None)
        given_up = undeliverable(item.deliveries, self._settings.max_deliveries)
        if given_up is not None:
            logger.error("dead-lettering %s: %s", item.request_id, given_up)
            self._counters.dead_lettered_requests += 1
            return Refused(given_up, FinishReason.ERROR, dead_letter=True)
        earlier = continuation(item.request, item.record)
        if isinstance(earlier, str):
            self._counters.unresumable_requests += 1
            return Refused(f"its worker was lost and it cannot continue: {earlier}", FinishReason.ERROR)
        logger.info("continuing %s after %d events (delivery %d)", item.request_id, tracker.next_seq, item.deliveries)
        return self._run(item.request, tracker, earlier)

    def _run(
        self, message: GenerateRequest, tracker: RequestTracker, earlier: Continuation | None
    ) -> StartedRequest | Refused:
        reason = refusal(message, self._model)
        if reason is not None:
            return Refused(reason)
        generated = earlier.generated if earlier is not None else ()
        resume = None
        # Prompt logprobs still to send are scored by a prefill from position 0: no checkpoint then.
        scores_prompt = not tracker.prompt_logprobs_sent
        if self._checkpoints is not None and not scores_prompt:
            interval = self._settings.decode_checkpoint_interval
            resume = resume_point(self._checkpoints.manager, message, generated, interval)
        snapshots = self._checkpoints is not None
        try:
            request = engine_request(
                message, resume=resume, snapshots=snapshots, earlier=earlier, scores_prompt=scores_prompt
            )
            self._engine.add_request(request)
        except ValueError as exc:  # sampling settings out of range, or PromptTooLongError
            return Refused(str(exc))
        resumed = resume.length if resume is not None else 0
        if not generated:  # a fresh start, or one that sent nothing yet: this worker's checkpoint counts
            tracker.cached_tokens = min(resumed, len(message.prompt_token_ids))
        if earlier is not None:
            self._counters.resumed_requests += 1
            self._counters.resume_prefill_tokens += len(message.prompt_token_ids) + len(generated) - resumed
            self._counters.resume_checkpoint_tokens += resumed
        assert request.params.seed is not None
        return StartedRequest(message.request_id, request.params.seed, tracker.cached_tokens)
