"""The messages gateways and workers exchange through Redis, one frozen dataclass each.

Every message class carries two class-level constants the codec writes next to its fields: ``kind``
(which class this is) and ``version`` (the layout of its fields; bump it when a field changes).
A class that only added fields, each with a default, lists them in ``fields_added`` (field name ->
the version that added it): the codec then also reads its older versions, the added fields taking
their defaults, so a fleet can be upgraded readers first.
Fields hold plain values only (ints, floats, strings, bytes, lists, ``StrEnum`` members) so that the codec
can check each one against its annotation. ``__post_init__`` checks the invariants a field type
cannot express; a violation raises ``ValueError``, which ``codec.decode`` turns into a
``DecodeError``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, TypeAlias


class Priority(StrEnum):
    """Which request stream a request waits in; interactive is always served first."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class FinishReason(StrEnum):
    """Why a choice stopped generating. ``REFUSED`` and ``ERROR`` carry an error message: the request
    cannot run as asked (the client's to fix, HTTP 400), or the fleet failed to run it (HTTP 500)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    REFUSED = "refused"
    ERROR = "error"

    @property
    def is_error(self) -> bool:
        """Whether the choice ended without an answer, with an error message."""
        return self in (FinishReason.REFUSED, FinishReason.ERROR)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A tokenized prompt and how to sample its continuation; queued by a gateway, run by one worker.

    ``top_k == 0`` and ``min_p == 0.0`` disable those filters. ``seed`` makes sampling reproducible
    per request and position (a resumed request continues identically). ``checkpoint_positions`` are
    prompt positions (token counts, strictly increasing, within ``1..len(prompt_token_ids)``) after
    which the worker should snapshot the recurrent state, e.g. the end of a system prompt.
    ``deadline`` and ``created_at`` are unix seconds. ``live_events`` False (a request answered whole,
    e.g. a non-streamed request or a batch line) asks the worker to publish only the request's first
    event (for its time to first token) and the final event of each choice; every event is still
    appended to the record, from which the reader fills the gap at once. ``keep_final_state`` asks for
    the state at the end to be checkpointed (before the final events go out), as a session's requests
    always are: a stored response, which the next one continues from its exact tokens. ``logit_bias``
    holds ``(token_id, bias)`` pairs added to the logits before the penalties (OpenAI's ``logit_bias``;
    a list, as msgpack map keys would have to be strings). ``grammar``, when set, is an llguidance Lark
    grammar (``metrale.text.grammars``) every choice's completion must match: the worker masks the
    tokens it does not allow before sampling, and allows only a stop token once it is complete.
    ``prompt_logprobs`` (None: none) asks for the log-probability of every prompt token after the
    first, with that many top alternatives each, computed in the prefill that fills the state (vLLM's
    ``prompt_logprobs``); they come back on ``TokenEvent.prompt_logprobs``. ``reply_to``, when set,
    names the token relay (one per gateway process, ``Keys.reply_channel``) that streams the request:
    the worker publishes its events there, grouped with the other requests that relay streams, one
    ``TokenEventGroup`` per step; without it, on the request's own ``Keys.token_channel``.
    ``speculative`` False keeps the request off speculative decoding on a worker that runs it (its
    tokens are the same either way; a worker without speculation has nothing to do for it).

    Version 2 added ``live_events``, ``keep_final_state``, ``logit_bias`` and ``grammar``
    (``fields_added``); a version 1 request decodes with their defaults (unconstrained). Version 3
    added ``prompt_logprobs``, version 4 ``reply_to``, version 5 ``speculative``.
    """

    kind: ClassVar[str] = "generate"
    version: ClassVar[int] = 5
    fields_added: ClassVar[Mapping[str, int]] = {
        "live_events": 2,
        "keep_final_state": 2,
        "logit_bias": 2,
        "grammar": 2,
        "prompt_logprobs": 3,
        "reply_to": 4,
        "speculative": 5,
    }

    request_id: str
    model: str
    tenant: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    priority: Priority = Priority.INTERACTIVE
    session_id: str | None = None
    checkpoint_positions: list[int] = field(default_factory=list)
    deadline: float | None = None
    created_at: float = field(default_factory=time.time)
    live_events: bool = True
    keep_final_state: bool = False
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    grammar: str | None = None
    prompt_logprobs: int | None = None
    reply_to: str | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        _require(self.grammar is None or self.grammar.strip() != "", "grammar must not be empty")
        _require(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs must be >= 0")
        _require(len(self.prompt_token_ids) > 0, "prompt_token_ids must not be empty")
        _require(self.max_tokens >= 1, "max_tokens must be >= 1")
        _require(self.temperature >= 0.0, "temperature must be >= 0")
        _require(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _require(self.top_k >= 0, "top_k must be >= 0 (0 disables it)")
        _require(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        _require(self.repetition_penalty > 0.0, "repetition_penalty must be > 0")
        _require(self.n >= 1, "n must be >= 1")
        _require(self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0")
        _require_strictly_increasing(self.checkpoint_positions, "checkpoint_positions")
        _require(
            all(0 < p <= len(self.prompt_token_ids) for p in self.checkpoint_positions),
            "checkpoint_positions must lie within 1..len(prompt_token_ids)",
        )
        _require(all(token_id >= 0 for token_id, _ in self.logit_bias), "logit_bias token ids must be >= 0")


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a finished request; ``cached_tokens`` were restored from a checkpoint."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def __post_init__(self) -> None:
        _require(min(self.prompt_tokens, self.completion_tokens, self.cached_tokens) >= 0, "negative count")
        _require(self.cached_tokens <= self.prompt_tokens, "cached_tokens exceeds prompt_tokens")


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens a worker emitted for one choice of a request, published on the request's channel.

    ``seq`` numbers every event of the request (all choices together) from 0 with no gaps, so a
    reader can drop duplicates and detect holes. ``logprobs[i]`` belongs to ``token_ids[i]``;
    ``top_logprobs[i]`` lists that position's ``(token_id, logprob)`` alternatives. The final event
    of a choice has ``finished`` set and a ``finish_reason``; ``usage`` rides on the final event only.

    ``prompt_logprobs`` (requests that asked for them) carries the log-probabilities of prompt tokens,
    on events of choice 0 without tokens, sent before any token of the request: the events of a request
    carry, in ``seq`` order, the prompt positions ``1, 2, ...`` each exactly once (position 0 has none);
    ``prompt_top_logprobs[i]`` lists that position's ``(token_id, logprob)`` alternatives, best first.

    Version 2 added ``prompt_logprobs`` and ``prompt_top_logprobs``.
    """

    kind: ClassVar[str] = "token"
    version: ClassVar[int] = 2
    fields_added: ClassVar[Mapping[str, int]] = {"prompt_logprobs": 2, "prompt_top_logprobs": 2}

    request_id: str
    index: int
    seq: int
    token_ids: list[int]
    worker_id: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    def __post_init__(self) -> None:
        _require(self.index >= 0, "index must be >= 0")
        _require(self.seq >= 0, "seq must be >= 0")
        _require(self.finished == (self.finish_reason is not None), "finish_reason is set iff finished")
        _require(self.usage is None or self.finished, "usage is only sent on the final event")
        _require(
            self.error is None or (self.finish_reason is not None and self.finish_reason.is_error),
            "error message requires finish_reason 'error' or 'refused'",
        )
        tokens = len(self.token_ids)
        _require(self.logprobs is None or len(self.logprobs) == tokens, "logprobs must have one entry per token")
        _require(
            self.top_logprobs is None or len(self.top_logprobs) == tokens, "top_logprobs must have one entry per token"
        )
        if self.prompt_logprobs is not None:
            _require(not tokens and self.index == 0, "prompt_logprobs ride on events of choice 0 without tokens")
        top = self.prompt_top_logprobs
        _require(
            top is None or (self.prompt_logprobs is not None and len(top) == len(self.prompt_logprobs)),
            "prompt_top_logprobs must have one entry per prompt logprob",
        )


@dataclass(frozen=True, slots=True)
class TokenEventGroup:
    """The token events of one worker step for every request one relay streams (``GenerateRequest.
    reply_to``), published once on that relay's ``Keys.reply_channel``.

    ``events`` holds each ``TokenEvent`` encoded by the codec (the very bytes appended to the
    request's record), in the order written: each request's in ``seq`` order. A reader decodes the
    group once and each event from its bytes; an event that does not decode is the reader's to set
    aside, the rest are delivered.
    """

    kind: ClassVar[str] = "token_group"
    version: ClassVar[int] = 1

    events: list[bytes]

    def __post_init__(self) -> None:
        _require(len(self.events) > 0, "a group holds at least one event")


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """Stop a request wherever it runs; broadcast on the cancel channel."""

    kind: ClassVar[str] = "cancel"
    version: ClassVar[int] = 1

    request_id: str
    reason: str


class WorkerState(StrEnum):
    """What a live worker is doing with the queue: taking new requests, or draining (taking none,
    handing back or finishing what it runs, then exiting)."""

    TAKING = "taking"
    DRAINING = "draining"


SPEC_DRAFT_TOKENS_COUNTER = "spec_draft_tokens"
SPEC_ACCEPTED_TOKENS_COUNTER = "spec_accepted_tokens"
"""The heartbeat counters of speculative decoding's draft tokens verified and accepted since the worker
started (a worker that has verified no draft sends neither)."""


@dataclass(frozen=True, slots=True)
class WorkerHeartbeat:
    """A worker's liveness and load, rewritten every few seconds under a TTL.

    ``running``/``waiting``/``swapped`` count sequences in each scheduler queue; ``free_slots`` and
    ``free_blocks`` are the recurrent-state slots and MLA KV blocks still available, of
    ``total_slots`` and ``total_blocks``. ``step_time_s`` is the mean engine step over the recent
    window (0 when idle), ``device`` where the model runs (``cpu``, ``cuda``, ``cuda:1``) and
    ``counters`` what this worker did since it started (name, count), e.g. preemptions and resumes.
    ``started_at`` and ``sent_at`` are unix seconds.

    ``probe_step_s`` is how long one engine step took with every slot decoding, measured at start-up
    on the worker's own model (``worker/fleet/step_probe.py``); ``full_step_s`` how long the worker's
    loop has recently taken per step while every slot was busy (stepping, publishing, waiting for
    the CPU: 0 until it ran full). With the slots they say how fast requests can leave them before
    any has finished (0: unknown).
    ``slot_ages_ms`` says how long before ``sent_at`` each request running here was taken: with the
    time a request holds a slot, when each slot should free.

    Version 2 added the fields after ``sent_at`` (``fields_added``), version 3 ``probe_step_s``,
    ``full_step_s`` and ``slot_ages_ms``; an
    older heartbeat, from a worker not yet upgraded, still decodes, with their defaults (0 totals
    mean unknown).
    """

    kind: ClassVar[str] = "heartbeat"
    version: ClassVar[int] = 3
    fields_added: ClassVar[Mapping[str, int]] = {
        "device": 2,
        "state": 2,
        "step_time_s": 2,
        "total_slots": 2,
        "total_blocks": 2,
        "counters": 2,
        "probe_step_s": 3,
        "full_step_s": 3,
        "slot_ages_ms": 3,
    }

    worker_id: str
    model: str
    running: int
    waiting: int
    swapped: int
    batch_size: int
    tokens_per_s: float
    free_slots: int
    free_blocks: int
    started_at: float
    sent_at: float
    device: str = ""
    state: WorkerState = WorkerState.TAKING
    step_time_s: float = 0.0
    total_slots: int = 0
    total_blocks: int = 0
    counters: list[tuple[str, int]] = field(default_factory=list)
    probe_step_s: float = 0.0
    full_step_s: float = 0.0
    slot_ages_ms: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        counts = (
            self.running,
            self.waiting,
            self.swapped,
            self.batch_size,
            self.free_slots,
            self.free_blocks,
            self.total_slots,
            self.total_blocks,
        )
        _require(min(counts) >= 0, "counts must be >= 0")
        _require(self.tokens_per_s >= 0.0, "tokens_per_s must be >= 0")
        _require(self.step_time_s >= 0.0, "step_time_s must be >= 0")
        _require(self.probe_step_s >= 0.0 and self.full_step_s >= 0.0, "step times must be >= 0")

    @property
    def used_slots(self) -> int | None:
        """Slots in use, when the worker says how many it has."""
        return self.total_slots - self.free_slots if self.total_slots else None

    @property
    def used_blocks(self) -> int | None:
        """KV blocks in use, when the worker says how many it has."""
        return self.total_blocks - self.free_blocks if self.total_blocks else None

    @property
    def acceptance(self) -> float | None:
        """Speculative decoding's draft tokens accepted per draft token verified, since the worker
        started; None before its first draft (or without speculation)."""
        counts = dict(self.counters)
        drafted = counts.get(SPEC_DRAFT_TOKENS_COUNTER, 0)
        return counts.get(SPEC_ACCEPTED_TOKENS_COUNTER, 0) / drafted if drafted else None


class ControlAction(StrEnum):
    """What an operator can ask one worker to do."""

    DRAIN = "drain"
    """Stop taking requests, hand back (or finish) what runs, exit: what SIGTERM does."""


@dataclass(frozen=True, slots=True)
class WorkerControl:
    """An operator's order to one worker (``met top``'s ``d``), published on its control channel."""

    kind: ClassVar[str] = "control"
    version: ClassVar[int] = 1

    worker_id: str
    action: ControlAction
    reason: str


@dataclass(frozen=True, slots=True)
class ModelAnnouncement:
    """What a gateway needs to serve a model: its tokenizer, chat template and limits.

    ``tokenizer_json`` is the text of ``tokenizer.json`` (a folder without one announces the tokenizer
    converted from its ``tiktoken.model`` in that format); ``tokenizer_config_json`` the text of
    ``tokenizer_config.json`` (it holds the chat template). ``fingerprint`` identifies the exact
    weights; checkpoints are keyed by it. ``generation_config_json`` is the text of the folder's
    ``generation_config.json`` (``{}`` when absent): its sampling values are the defaults of the
    fields a request leaves out (vLLM's ``--generation-config auto``).

    Version 2 added ``generation_config_json`` (``fields_added``); a version 1 announcement decodes
    with ``{}`` (no defaults).
    """

    kind: ClassVar[str] = "model"
    version: ClassVar[int] = 2
    fields_added: ClassVar[Mapping[str, int]] = {"generation_config_json": 2}

    model: str
    tokenizer_json: str
    tokenizer_config_json: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    fingerprint: str
    generation_config_json: str = "{}"

    def __post_init__(self) -> None:
        _require(self.max_model_len >= 1, "max_model_len must be >= 1")
        _require(self.vocab_size >= 1, "vocab_size must be >= 1")
        _require(all(0 <= t < self.vocab_size for t in self.eos_token_ids), "eos_token_ids outside vocab")


Message: TypeAlias = (
    GenerateRequest | TokenEvent | TokenEventGroup | CancelRequest | WorkerHeartbeat | ModelAnnouncement | WorkerControl
)
"""Any message that travels through Redis."""

MESSAGE_TYPES: tuple[type[Message], ...] = (
    GenerateRequest,
    TokenEvent,
    TokenEventGroup,
    CancelRequest,
    WorkerHeartbeat,
    ModelAnnouncement,
    WorkerControl,
)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_strictly_increasing(values: Sequence[int], name: str) -> None:
    _require(all(a < b for a, b in itertools.pairwise(values)), f"{name} must strictly increase")
