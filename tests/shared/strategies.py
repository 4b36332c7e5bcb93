"""Hypothesis strategies that draw every valid message (any field value the invariants allow)."""

from __future__ import annotations

from hypothesis import strategies as st

from metrale.shared.messages import (
    CancelRequest,
    ControlAction,
    FinishReason,
    GenerateRequest,
    Message,
    ModelAnnouncement,
    Priority,
    TokenEvent,
    TokenEventGroup,
    Usage,
    WorkerControl,
    WorkerHeartbeat,
    WorkerState,
)

# msgpack carries integers in [-2**63, 2**64).
wire_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
counts = st.integers(min_value=0, max_value=2**32)
token_ids = st.integers(min_value=0, max_value=2**31 - 1)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
timestamps = st.floats(min_value=0.0, max_value=4e9)
texts = st.text(max_size=24)
# ids that are also valid Redis key segments (see metrale.shared.keys)
key_ids = st.from_regex(r"[A-Za-z0-9._\-/@+=]{1,32}", fullmatch=True)


@st.composite
def generate_requests(draw: st.DrawFn) -> GenerateRequest:
    prompt = draw(st.lists(token_ids, min_size=1, max_size=32))
    positions = draw(st.sets(st.integers(min_value=1, max_value=len(prompt)), max_size=4))
    return GenerateRequest(
        request_id=draw(texts),
        model=draw(texts),
        tenant=draw(texts),
        prompt_token_ids=prompt,
        max_tokens=draw(st.integers(min_value=1, max_value=2**31)),
        temperature=draw(st.floats(min_value=0.0, max_value=100.0)),
        top_p=draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=True)),
        top_k=draw(st.integers(min_value=0, max_value=2**20)),
        min_p=draw(st.floats(min_value=0.0, max_value=1.0)),
        presence_penalty=draw(finite_floats),
        frequency_penalty=draw(finite_floats),
        repetition_penalty=draw(st.floats(min_value=0.0, exclude_min=True, allow_infinity=False)),
        stop_token_ids=draw(st.lists(token_ids, max_size=4)),
        ignore_eos=draw(st.booleans()),
        seed=draw(st.none() | wire_ints),
        n=draw(st.integers(min_value=1, max_value=16)),
        logprobs=draw(st.none() | st.integers(min_value=0, max_value=20)),
        priority=draw(st.sampled_from(Priority)),
        session_id=draw(st.none() | texts),
        checkpoint_positions=sorted(positions),
        deadline=draw(st.none() | timestamps),
        created_at=draw(timestamps),
        logit_bias=draw(st.lists(st.tuples(token_ids, st.floats(min_value=-100.0, max_value=100.0)), max_size=4)),
        grammar=draw(st.none() | texts.filter(str.strip)),
        reply_to=draw(st.none() | key_ids),
        speculative=draw(st.booleans()),
    )


@st.composite
def usages(draw: st.DrawFn) -> Usage:
    prompt_tokens = draw(counts)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=draw(counts),
        cached_tokens=draw(st.integers(min_value=0, max_value=prompt_tokens)),
    )


@st.composite
def token_events(draw: st.DrawFn, request_ids: st.SearchStrategy[str] = texts) -> TokenEvent:
    tokens = draw(st.lists(token_ids, max_size=8))
    logprob = st.floats(max_value=0.0)  # -inf is a legitimate logprob
    finish_reason = draw(st.none() | st.sampled_from(FinishReason))
    finished = finish_reason is not None
    index = draw(st.integers(min_value=0, max_value=15))
    prompt_logprobs = None
    prompt_top_logprobs = None
    if not tokens and index == 0:
        prompt_logprobs = draw(st.none() | st.lists(logprob, max_size=4))
        if prompt_logprobs is not None:
            alternatives = st.lists(st.tuples(token_ids, logprob), max_size=3)
            size = len(prompt_logprobs)
            prompt_top_logprobs = draw(st.none() | st.lists(alternatives, min_size=size, max_size=size))
    return TokenEvent(
        request_id=draw(request_ids),
        index=index,
        seq=draw(counts),
        token_ids=tokens,
        worker_id=draw(texts),
        logprobs=draw(st.none() | st.lists(logprob, min_size=len(tokens), max_size=len(tokens))),
        top_logprobs=draw(
            st.none()
            | st.lists(
                st.lists(st.tuples(token_ids, logprob), max_size=3),
                min_size=len(tokens),
                max_size=len(tokens),
            )
        ),
        finished=finished,
        finish_reason=finish_reason,
        error=draw(st.none() | texts) if finish_reason is not None and finish_reason.is_error else None,
        usage=draw(st.none() | usages()) if finished else None,
        prompt_logprobs=prompt_logprobs,
        prompt_top_logprobs=prompt_top_logprobs,
    )


cancel_requests = st.builds(CancelRequest, request_id=texts, reason=texts)

worker_heartbeats = st.builds(
    WorkerHeartbeat,
    worker_id=texts,
    model=texts,
    running=counts,
    waiting=counts,
    swapped=counts,
    batch_size=counts,
    tokens_per_s=st.floats(min_value=0.0, allow_infinity=False),
    free_slots=counts,
    free_blocks=counts,
    started_at=timestamps,
    sent_at=timestamps,
    device=texts,
    state=st.sampled_from(WorkerState),
    step_time_s=st.floats(min_value=0.0, allow_infinity=False),
    total_slots=counts,
    total_blocks=counts,
    counters=st.lists(st.tuples(texts, wire_ints), max_size=4),
)

worker_controls = st.builds(WorkerControl, worker_id=texts, action=st.sampled_from(ControlAction), reason=texts)


@st.composite
def model_announcements(draw: st.DrawFn) -> ModelAnnouncement:
    vocab_size = draw(st.integers(min_value=1, max_value=2**20))
    return ModelAnnouncement(
        model=draw(texts),
        tokenizer_json=draw(st.text(max_size=200)),
        tokenizer_config_json=draw(st.text(max_size=200)),
        max_model_len=draw(st.integers(min_value=1, max_value=2**24)),
        vocab_size=vocab_size,
        eos_token_ids=draw(st.lists(st.integers(min_value=0, max_value=vocab_size - 1), max_size=3)),
        fingerprint=draw(texts),
        generation_config_json=draw(st.text(max_size=200)),
    )


token_event_groups = st.builds(TokenEventGroup, events=st.lists(st.binary(max_size=16), min_size=1, max_size=4))

MESSAGE_STRATEGIES: dict[str, st.SearchStrategy[Message]] = {
    "generate": generate_requests(),
    "token": token_events(),
    "token_group": token_event_groups,
    "cancel": cancel_requests,
    "heartbeat": worker_heartbeats,
    "model": model_announcements(),
    "control": worker_controls,
}

messages: st.SearchStrategy[Message] = st.one_of(*MESSAGE_STRATEGIES.values())
