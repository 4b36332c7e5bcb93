from __future__ import annotations

import copy
import dataclasses
import functools
import operator
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.shared import codec
from metrale.shared.codec import DecodeError, decode, encode, encode_reference
from metrale.shared.messages import (
    MESSAGE_TYPES,
    CancelRequest,
    FinishReason,
    GenerateRequest,
    Message,
    TokenEvent,
    TokenEventGroup,
    Usage,
    WorkerHeartbeat,
    WorkerState,
)
from tests.shared.strategies import MESSAGE_STRATEGIES, messages, token_event_groups, token_events

PROPERTY = settings(derandomize=True, deadline=None, max_examples=100)

# Any value msgpack can carry, to plant in a payload where a field was.
wire_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def sample_event() -> TokenEvent:
    return TokenEvent(
        request_id="req-1",
        index=0,
        seq=4,
        token_ids=[11, 12],
        worker_id="w-1",
        logprobs=[-0.5, -1.5],
        top_logprobs=[[(11, -0.5), (7, -2.0)], [(12, -1.5)]],
        finished=True,
        finish_reason=FinishReason.STOP,
        usage=Usage(prompt_tokens=5, completion_tokens=6, cached_tokens=2),
    )


def payload_of(message: Message) -> dict[str, Any]:
    payload: dict[str, Any] = msgpack.unpackb(encode(message))
    return payload


def pack(payload: Any) -> bytes:
    packed: bytes = msgpack.packb(payload)
    return packed


def test_every_message_type_has_a_strategy_and_a_unique_kind() -> None:
    kinds = [cls.kind for cls in MESSAGE_TYPES]
    assert sorted(kinds) == sorted(MESSAGE_STRATEGIES)
    assert len(set(kinds)) == len(kinds)


@pytest.mark.parametrize("kind", sorted(MESSAGE_STRATEGIES))
@PROPERTY
@given(data=st.data())
def test_round_trip_keeps_every_value_and_its_type(kind: str, data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[kind])
    decoded = decode(encode(message))
    assert decoded == message
    # repr shows what == hides: 1 vs 1.0, a tuple vs a list, an enum member vs its string.
    assert repr(decoded) == repr(message)


def test_wire_layout_names_kind_version_and_every_field() -> None:
    payload = payload_of(CancelRequest(request_id="r-9", reason="client went away"))
    assert payload == {"kind": "cancel", "v": 1, "request_id": "r-9", "reason": "client went away"}


def test_ints_are_widened_where_floats_are_due() -> None:
    payload = payload_of(GenerateRequest("r", "m", "t", [1], 4, created_at=1.5))
    payload["temperature"] = 0
    decoded = decode(pack(payload))
    assert isinstance(decoded, GenerateRequest)
    assert type(decoded.temperature) is float and decoded.temperature == 0.0


def _replace(field: str, value: Any) -> dict[str, Any]:
    payload = payload_of(sample_event())
    payload[field] = value
    return payload


def _without(field: str) -> dict[str, Any]:
    payload = payload_of(sample_event())
    del payload[field]
    return payload


def _usage_with(field: str, value: Any) -> dict[str, Any]:
    payload = payload_of(sample_event())
    payload["usage"][field] = value
    return payload


BAD_PAYLOADS = {
    "empty": (b"", "not a msgpack payload"),
    "reserved-byte": (b"\xc1", "not a msgpack payload"),
    "truncated": (encode(sample_event())[:-3], "not a msgpack payload"),
    "trailing-bytes": (encode(sample_event()) + b"\x00", "not a msgpack payload"),
    "top-level-array": (pack([1, 2, 3]), "not a map"),
    "top-level-int": (pack(7), "not a map"),
    "no-kind": (pack({"v": 1}), "unknown message kind"),
    "unknown-kind": (pack(_replace("kind", "teleport")), "unknown message kind 'teleport'"),
    "kind-not-str": (pack(_replace("kind", 3)), "unknown message kind"),
    "newer-version": (pack(_replace("v", 3)), "unsupported version 3"),
    "no-version": (pack(_without("v")), "unsupported version None"),
    "version-true": (pack(_replace("v", True)), "unsupported version True"),
    "missing-field": (pack(_without("seq")), "missing fields seq"),
    "unknown-field": (pack(_replace("colour", "red")), "unknown fields 'colour'"),
    "bool-for-int": (pack(_replace("seq", True)), "token.seq: expected int, got bool"),
    "float-for-int": (pack(_replace("seq", 4.0)), "token.seq: expected int, got float"),
    "str-for-int": (pack(_replace("index", "0")), "token.index: expected int"),
    "null-for-required": (pack(_replace("worker_id", None)), "token.worker_id: expected str, got NoneType"),
    "bytes-for-str": (pack(_replace("worker_id", b"w-1")), "token.worker_id: expected str, got bytes"),
    "str-for-array": (pack(_replace("token_ids", "11 12")), "token.token_ids: expected an array"),
    "bad-array-item": (pack(_replace("token_ids", [11, "12"])), "token.token_ids[1]: expected int"),
    "bad-pair-arity": (pack(_replace("top_logprobs", [[[11]], [[12, -1.5]]])), "top_logprobs[0][0]"),
    "unknown-enum": (pack(_replace("finish_reason", "bored")), "token.finish_reason: expected one of"),
    "array-for-map": (pack(_replace("usage", [5, 6, 2])), "token.usage: expected a map"),
    "nested-null": (pack(_usage_with("cached_tokens", None)), "usage.cached_tokens"),
    "invariant-seq": (pack(_replace("seq", -1)), "token: seq must be >= 0"),
    "invariant-finish": (pack(_replace("finished", False)), "token: finish_reason is set iff finished"),
    "ext-type": (pack(_replace("seq", msgpack.ExtType(5, b"x"))), "token.seq: expected int, got ExtType"),
}


@pytest.mark.parametrize(("data", "reason"), list(BAD_PAYLOADS.values()), ids=list(BAD_PAYLOADS))
def test_bad_payloads_become_decode_errors(data: bytes, reason: str) -> None:
    result = decode(data)
    assert isinstance(result, DecodeError)
    assert reason in result.reason
    assert result.size == len(data)


@PROPERTY
@given(data=st.binary(max_size=512))
def test_random_bytes_never_raise(data: bytes) -> None:
    assert isinstance(decode(data), DecodeError | Message)


@PROPERTY
@given(message=messages, edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4))
def test_corrupted_bytes_never_raise(message: Message, edits: list[tuple[int, int]]) -> None:
    data = bytearray(encode(message))
    for position, byte in edits:
        data[position % len(data)] = byte
    assert isinstance(decode(bytes(data)), DecodeError | Message)


@PROPERTY
@given(message=messages, cut=st.integers(min_value=1))
def test_truncated_payloads_are_rejected(message: Message, cut: int) -> None:
    data = encode(message)
    assert isinstance(decode(data[: len(data) - 1 - cut % len(data)]), DecodeError)


@PROPERTY
@given(message=messages, data=st.data())
def test_a_field_replaced_by_any_wire_value_never_raises(message: Message, data: st.DataObject) -> None:
    payload = payload_of(message)
    field = data.draw(st.sampled_from(sorted(payload)))
    payload[field] = data.draw(wire_values)
    result = decode(pack(payload))
    if not isinstance(result, DecodeError):
        assert decode(encode(result)) == result  # whatever was accepted is a well-formed message


@PROPERTY
@given(message=messages, data=st.data())
def test_any_missing_field_is_rejected(message: Message, data: st.DataObject) -> None:
    payload = payload_of(message)
    field = data.draw(st.sampled_from(sorted(set(payload) - {"kind", "v"})))
    del payload[field]
    result = decode(pack(payload))
    assert isinstance(result, DecodeError)
    assert field in result.reason


def _reference_bytes(message: Message) -> bytes:
    """The wire layout spelled out independently of the codec: kind, version, then every field in
    declaration order (nested dataclasses as maps, enum members as their string, tuples as arrays)."""
    payload = {"kind": message.kind, "v": message.version, **dataclasses.asdict(message)}
    packed: bytes = msgpack.packb(payload, use_bin_type=True)
    return packed


@pytest.mark.parametrize("kind", sorted(MESSAGE_STRATEGIES))
@PROPERTY
@given(data=st.data())
def test_encoded_bytes_follow_the_wire_layout(kind: str, data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[kind])
    assert encode(message) == _reference_bytes(message)


def _general_path(data: bytes) -> Message | DecodeError:
    """What ``decode`` answers without its token-event shortcut."""
    try:
        return codec._message_from(msgpack.unpackb(data))
    except ValueError as exc:
        return DecodeError(str(exc), len(data))


def _assert_answers_like_the_general_path(payload: dict[str, Any]) -> None:
    packed = pack(payload)
    decoded, expected = decode(packed), _general_path(packed)
    assert decoded == expected
    assert repr(decoded) == repr(expected)  # 1 vs 1.0, True vs 1, a tuple vs a list


KeyPath = tuple[str | int, ...]
"""Map keys and array positions leading to one value inside a payload."""


def _paths(value: Any, prefix: KeyPath = ()) -> list[KeyPath]:
    """The path of every value inside ``value``, containers included."""
    children: list[tuple[str | int, Any]] = []
    if isinstance(value, dict):
        children = list(value.items())
    elif isinstance(value, list):
        children = list(enumerate(value))
    paths = []
    for key, child in children:
        paths += [(*prefix, key), *_paths(child, (*prefix, key))]
    return paths


def _with(payload: dict[str, Any], path: KeyPath, value: Any) -> dict[str, Any]:
    """A deep copy of ``payload`` with the value at ``path`` replaced (or removed, for ``_REMOVED``)."""
    edited = copy.deepcopy(payload)
    container = functools.reduce(operator.getitem, path[:-1], edited)
    if value is _REMOVED:
        del container[path[-1]]
    else:
        container[path[-1]] = value
    return edited


_REMOVED = object()
# Values one cheap type test could mistake for another: bools for ints, ints for floats, enum strings.
CONFUSABLE_VALUES = [True, False, 0, 1, -1, 2.0, -0.5, "", "stop", None, [], [1], [1, 2.0], {}, b"", _REMOVED]
SHORTCUT_EVENTS = {
    "final-with-everything": sample_event(),
    "plain": TokenEvent(request_id="req-2", index=1, seq=0, token_ids=[3], worker_id="w-2"),
}


@pytest.mark.parametrize("event", list(SHORTCUT_EVENTS.values()), ids=list(SHORTCUT_EVENTS))
def test_token_event_shortcut_answers_like_the_general_path_for_every_edit(event: TokenEvent) -> None:
    payload = payload_of(event)
    _assert_answers_like_the_general_path(payload)
    for path in _paths(payload):
        for value in CONFUSABLE_VALUES:
            _assert_answers_like_the_general_path(_with(payload, path, value))


@PROPERTY
@given(event=token_events())
def test_a_plain_event_decodes_to_the_event_its_constructor_makes(event: TokenEvent) -> None:
    """Built with its slots set directly: equal, the same repr, frozen, as ``TokenEvent(...)`` builds it."""
    plain = TokenEvent(event.request_id, event.index, event.seq, list(event.token_ids), event.worker_id)
    decoded = decode(encode(plain))
    assert decoded == plain
    assert repr(decoded) == repr(plain)
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.seq = 0  # type: ignore[misc]


def test_token_group_shortcut_answers_like_the_general_path_for_every_edit() -> None:
    payload = payload_of(TokenEventGroup([encode(sample_event()), b"\x00", b""]))
    _assert_answers_like_the_general_path(payload)
    for path in _paths(payload):
        for value in CONFUSABLE_VALUES:
            _assert_answers_like_the_general_path(_with(payload, path, value))


@PROPERTY
@given(group=token_event_groups, data=st.data())
def test_token_group_shortcut_answers_like_the_general_path(group: TokenEventGroup, data: st.DataObject) -> None:
    payload = payload_of(group)
    _assert_answers_like_the_general_path(payload)
    path = data.draw(st.sampled_from(_paths(payload)), label="path")
    _assert_answers_like_the_general_path(_with(payload, path, data.draw(wire_values, label="value")))


def test_a_version_1_token_event_decodes_without_prompt_logprobs() -> None:
    event = sample_event()
    payload = {**payload_of(event), "v": 1}
    del payload["prompt_logprobs"], payload["prompt_top_logprobs"]
    assert decode(pack(payload)) == event


def test_prompt_logprobs_travel_on_an_event_without_tokens() -> None:
    event = TokenEvent(
        "r", 0, 0, [], "w", prompt_logprobs=[-1.5, -0.25], prompt_top_logprobs=[[(3, -0.5)], [(4, -0.25)]]
    )
    assert encode(event) == encode_reference(event)
    assert decode(encode(event)) == event
    with pytest.raises(ValueError, match="choice 0 without tokens"):
        TokenEvent("r", 0, 0, [7], "w", prompt_logprobs=[-1.0])
    with pytest.raises(ValueError, match="one entry per prompt logprob"):
        TokenEvent("r", 0, 0, [], "w", prompt_logprobs=[-1.0], prompt_top_logprobs=[])


@PROPERTY
@given(event=token_events(), data=st.data())
def test_token_event_shortcut_answers_like_the_general_path(event: TokenEvent, data: st.DataObject) -> None:
    payload = payload_of(event)
    path = data.draw(st.sampled_from(_paths(payload)), label="path")
    _assert_answers_like_the_general_path(_with(payload, path, data.draw(wire_values, label="value")))


def _heartbeat_v1_payload() -> dict[str, Any]:
    """A heartbeat as a worker of version 1 wrote it: no field added since."""
    beat = WorkerHeartbeat("w-1", "tiny", 2, 1, 0, 2, 12.5, 6, 40, started_at=1.0, sent_at=2.0)
    payload = payload_of(beat)
    for name in WorkerHeartbeat.fields_added:
        del payload[name]
    return {**payload, "v": 1}


def test_a_version_1_heartbeat_decodes_with_the_added_fields_at_their_defaults() -> None:
    decoded = decode(pack(_heartbeat_v1_payload()))
    assert decoded == WorkerHeartbeat("w-1", "tiny", 2, 1, 0, 2, 12.5, 6, 40, started_at=1.0, sent_at=2.0)
    assert isinstance(decoded, WorkerHeartbeat) and decoded.state is WorkerState.TAKING
    assert decoded.used_slots is None  # a version 1 worker does not say how many it has


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda p: p | {"state": "draining"}, "unknown fields 'state'"),  # v1 never carried it
        (lambda p: p | {"v": 0}, "unsupported version 0"),
        (lambda p: p | {"v": 4}, "unsupported version 4"),
    ],
    ids=["v1-with-a-v2-field", "v0", "v4"],
)
def test_heartbeat_versions_outside_what_was_written_are_refused(edit: Any, reason: str) -> None:
    result = decode(pack(edit(_heartbeat_v1_payload())))
    assert isinstance(result, DecodeError) and reason in result.reason


def test_a_version_2_heartbeat_must_carry_its_added_fields() -> None:
    beat = WorkerHeartbeat("w-1", "tiny", 0, 0, 0, 0, 0.0, 4, 4, 1.0, 2.0, "cpu", WorkerState.DRAINING, 0.01, 4, 8)
    payload = payload_of(beat)
    assert decode(pack(payload)) == beat
    del payload["device"]
    result = decode(pack(payload))
    assert isinstance(result, DecodeError) and "missing fields device" in result.reason


def test_a_version_2_heartbeat_decodes_without_step_times_or_slot_ages() -> None:
    beat = WorkerHeartbeat("w-1", "tiny", 0, 0, 0, 0, 0.0, 4, 4, 1.0, 2.0, "cpu", WorkerState.TAKING, 0.01, 4, 8)
    payload = {**payload_of(beat), "v": 2}
    del payload["probe_step_s"], payload["full_step_s"], payload["slot_ages_ms"]
    assert decode(pack(payload)) == beat
    assert decode(pack(payload | {"full_step_s": 0.5})) != beat  # a v2 payload never carried it


def test_a_version_1_generate_request_decodes_with_the_added_fields_defaults() -> None:
    request = GenerateRequest("r", "m", "t", [1, 2], 4, created_at=1.5)
    payload = {**payload_of(request), "v": 1}
    for added in GenerateRequest.fields_added:
        del payload[added]
    assert decode(pack(payload)) == request
    del payload["created_at"]  # a field of version 1 is still required
    assert isinstance(decode(pack(payload)), DecodeError)


def test_a_version_4_generate_request_decodes_as_speculative() -> None:
    """A gateway not yet upgraded sends no ``speculative``: the request may be drafted for, as before."""
    request = GenerateRequest("r", "m", "t", [1, 2], 4, created_at=1.5)
    payload = {**payload_of(request), "v": 4}
    del payload["speculative"]
    assert decode(pack(payload)) == request
    result = decode(pack({**payload_of(dataclasses.replace(request, speculative=False)), "v": 4}))
    assert isinstance(result, DecodeError) and "unknown fields 'speculative'" in result.reason


def test_logit_bias_travels_as_pairs() -> None:
    request = GenerateRequest("r", "m", "t", [1], 4, created_at=1.5, logit_bias=[(5, 100.0), (9, -3)])
    assert payload_of(request)["logit_bias"] == [[5, 100.0], [9, -3]]
    decoded = decode(encode(request))
    assert isinstance(decoded, GenerateRequest) and decoded.logit_bias == [(5, 100.0), (9, -3.0)]


def test_a_version_1_generate_request_cannot_carry_a_grammar() -> None:
    payload = payload_of(GenerateRequest("r", "m", "t", [1], 4, created_at=1.5, grammar='start: "a"'))
    result = decode(pack({**payload, "v": 1}))
    assert isinstance(result, DecodeError) and "unknown fields 'grammar'" in result.reason


@PROPERTY
@given(event=token_events(), data=st.data())
def test_a_token_event_encodes_to_the_bytes_of_the_general_path(event: TokenEvent, data: st.DataObject) -> None:
    plain = data.draw(st.booleans())  # half of them made plain, so the fast path is taken often
    if plain and not event.finished:
        event = dataclasses.replace(event, logprobs=None, top_logprobs=None)
    assert encode(event) == codec.encode_reference(event)
    assert decode(encode(event)) == event


@pytest.mark.parametrize(
    "event",
    [
        TokenEvent("r", 0, 0, [], "w"),
        TokenEvent("r" * 300, 15, 2**40, list(range(70000, 70020)), "w" * 40),
        TokenEvent("r", 1, 3, [5], "w", top_logprobs=[[(5, -0.1)]]),  # alternatives without logprobs
    ],
    ids=["no-tokens", "long-fields", "top-logprobs-only"],
)
def test_edge_token_events_encode_like_the_general_path(event: TokenEvent) -> None:
    assert encode(event) == codec.encode_reference(event)


@PROPERTY
@given(event=token_events(), edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3))
def test_plain_event_bytes_decode_as_the_general_path_decodes_them(
    event: TokenEvent, edits: list[tuple[int, int]]
) -> None:
    data = bytearray(encode(dataclasses.replace(event, logprobs=None, top_logprobs=None)))
    for position, value in edits:  # damaged anywhere, the head and tail included
        data[position % len(data)] = value
    assert decode(bytes(data)) == codec.decode_reference(bytes(data))


@pytest.mark.parametrize(
    "varying",
    [
        ["request_id", "r", "index", -1, "seq", 0, "token_ids", [1], "worker_id", "w"],
        ["request_id", "r", "index", 0, "seq", 0, "token_ids", [True], "worker_id", "w"],
        ["index", 0, "request_id", "r", "seq", 0, "token_ids", [1], "worker_id", "w"],
        ["request_id", "r", "index", 0, "seq", 0, "token_ids", [1], "worker_id", "w", "extra", 1],
    ],
    ids=["negative-index", "bool-token", "keys-reordered", "eleven-entries"],
)
def test_odd_plain_layouts_decode_as_the_general_path_decodes_them(varying: list[Any]) -> None:
    head, tail = codec._PLAIN_EVENT_HEAD, codec._PLAIN_EVENT_TAIL
    data = head + msgpack.packb(varying)[1:] + tail
    assert decode(data) == codec.decode_reference(data)
