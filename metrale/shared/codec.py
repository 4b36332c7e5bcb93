"""The versioned msgpack codec for every message in ``messages``.

Wire layout: one msgpack map holding ``kind`` (the message class), ``v`` (that class's ``version``)
and every dataclass field by name. Enum members travel as their string value, tuples and lists as
arrays, nested dataclasses (``Usage``) as maps.

A message class may name in ``fields_added`` the fields each later version added (all with
defaults); a payload of an older version must then carry exactly the fields it had, and the added
ones take their defaults. Any version newer than the class's, or older than its first, is refused.

``decode`` never raises on bad input. Garbage bytes, an unknown kind, another version, a missing,
unknown or wrongly-typed field, or a broken message invariant all come back as a ``DecodeError``,
which the worker moves to the dead-letter stream. Field types are checked against each dataclass
annotation exactly: ``True`` is not an int, an int is accepted (and widened) where a float is due,
and a payload must carry every field, including those that have defaults in Python.

Token events are most of the traffic. ``encode`` writes a plain one (tokens only, not final) from
constant bytes around one packed array of its varying fields, the same bytes as the general path
(``encode_reference``) writes; ``decode`` reads such bytes back the same way (``_plain_token_event_from``),
and otherwise first tries ``_token_event``: the same checks
written as plain type tests for that one layout. It accepts exactly what the general path accepts
and builds the same event; anything it does not accept goes through the general path, which says
what is wrong. A ``TokenEventGroup`` (one per step per relay, holding a step's events) is read the
same way (``_token_event_group``): the general path checks each of its events' bytes as a field of
its own, which cost a relay more per token than the event's own decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack

from metrale.shared.messages import MESSAGE_TYPES, FinishReason, Message, TokenEvent, TokenEventGroup, Usage

_KIND = "kind"
_VERSION = "v"
_MESSAGE_CLASSES: dict[str, type[Message]] = {cls.kind: cls for cls in MESSAGE_TYPES}
_FIELD_NAMES: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in (*MESSAGE_TYPES, Usage)
}
_TOKEN_EVENT_KEYS = frozenset({_KIND, _VERSION, *_FIELD_NAMES[TokenEvent]})
_TOKEN_GROUP_KEYS = frozenset({_KIND, _VERSION, *_FIELD_NAMES[TokenEventGroup]})
_USAGE_KEYS = frozenset(_FIELD_NAMES[Usage])
_FINISH_REASONS: dict[str, FinishReason] = {reason.value: reason for reason in FinishReason}
_READABLE_VERSIONS: dict[str, range] = {
    cls.kind: range(min([cls.version, *(v - 1 for v in getattr(cls, "fields_added", {}).values())]), cls.version + 1)
    for cls in MESSAGE_TYPES
}


@dataclass(frozen=True, slots=True)
class DecodeError:
    """Why a payload could not be decoded; ``size`` is the payload's length in bytes."""

    reason: str
    size: int


class _InvalidPayload(ValueError):
    """A payload that does not match its message's schema."""


def encode(message: Message) -> bytes:
    """Serialize ``message`` with its kind and version; the inverse of ``decode``."""
    if isinstance(message, TokenEvent) and _is_plain(message):
        return _plain_token_event(message)
    return encode_reference(message)


def encode_reference(message: Message) -> bytes:
    """``encode`` through the general path only: the payload map of every field, packed at once."""
    packed: bytes = msgpack.packb(_to_wire(message), use_bin_type=True, default=_nested_to_wire)
    return packed


# A Packer without a ``default`` hook never calls back into Python, so one ``pack`` holds the GIL
# throughout and the packer can be shared between threads.
_PACKER = msgpack.Packer(use_bin_type=True)
_PLAIN_EVENT_HEAD = b"\x8f" + b"".join(map(_PACKER.pack, [_KIND, TokenEvent.kind, _VERSION, TokenEvent.version]))
_PLAIN_EVENT_TAIL = b"".join(
    map(_PACKER.pack, ["logprobs", None, "top_logprobs", None, "finished", False, "finish_reason", None])
) + b"".join(map(_PACKER.pack, ["error", None, "usage", None, "prompt_logprobs", None, "prompt_top_logprobs", None]))


_PLAIN_EVENT_KEYS = ["request_id", "index", "seq", "token_ids", "worker_id"]


def _is_plain(event: TokenEvent) -> bool:
    """Tokens only: not final (so no usage and no error either), no logprobs of any kind."""
    plain = not event.finished and event.logprobs is None and event.top_logprobs is None
    return plain and event.prompt_logprobs is None and event.prompt_top_logprobs is None


def _plain_token_event(event: TokenEvent) -> bytes:
    """A not-final event without logprobs (so without error and usage either): the payload map's
    15 entries are its kind and version, 5 varying fields and 8 constant ones. The varying ones, with
    their keys, are packed as one 10-element array, whose 1-byte header (``0x9a``) is dropped: what
    follows it is exactly that part of the map."""
    varying = (
        "request_id",
        event.request_id,
        "index",
        event.index,
        "seq",
        event.seq,
        "token_ids",
        event.token_ids,
        "worker_id",
        event.worker_id,
    )
    packed: bytes = _PACKER.pack(varying)
    return _PLAIN_EVENT_HEAD + packed[1:] + _PLAIN_EVENT_TAIL


def decode(data: bytes) -> Message | DecodeError:
    """Parse one payload written by ``encode``; never raises, bad input yields a ``DecodeError``."""
    if data.startswith(_PLAIN_EVENT_HEAD) and data.endswith(_PLAIN_EVENT_TAIL):
        event = _plain_token_event_from(data)
        if event is not None:
            return event
    return decode_reference(data)


def decode_reference(data: bytes) -> Message | DecodeError:
    """``decode`` without the plain token event's bytes layout: the payload unpacked as one map."""
    try:
        payload = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        return DecodeError(f"not a msgpack payload ({type(exc).__name__}: {exc})", len(data))
    if type(payload) is dict and payload.get(_KIND) == TokenEvent.kind:
        event = _token_event(payload)
        if event is not None:
            return event
    if type(payload) is dict and payload.get(_KIND) == TokenEventGroup.kind:
        group = _token_event_group(payload)
        if group is not None:
            return group
    try:
        return _message_from(payload)
    except ValueError as exc:  # _InvalidPayload, or an invariant broken in __post_init__
        return DecodeError(str(exc), len(data))


def _to_wire(message: Message) -> dict[str, Any]:
    """The payload map; msgpack packs enum members (``StrEnum``) as their string, tuples as arrays,
    and hands nested dataclasses to ``_nested_to_wire``."""
    payload: dict[str, Any] = {_KIND: message.kind, _VERSION: message.version}
    for name in _FIELD_NAMES[type(message)]:
        payload[name] = getattr(message, name)
    return payload


def _nested_to_wire(value: Any) -> Any:
    if type(value) in _FIELD_NAMES:
        return {name: getattr(value, name) for name in _FIELD_NAMES[type(value)]}
    raise TypeError(f"the codec cannot carry a {type(value).__name__}")


def _plain_token_event_from(data: bytes) -> TokenEvent | None:
    """The event in ``data`` if it is laid out as ``_plain_token_event`` writes it and well formed,
    else None (the general path decides). msgpack is parsed front to back, so when the bytes between
    the constant head and tail unpack as exactly one 10-element array, the map holds exactly those
    entries: its key names are checked in order, the values' types as ``_token_event`` does."""
    middle = data[len(_PLAIN_EVENT_HEAD) : len(data) - len(_PLAIN_EVENT_TAIL)]
    try:
        varying = msgpack.unpackb(b"\x9a" + middle, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if type(varying) is not list or len(varying) != 10 or varying[0::2] != _PLAIN_EVENT_KEYS:
        return None
    request_id, index, seq, token_ids, worker_id = varying[1::2]
    well_typed = (
        type(request_id) is str
        and type(index) is int
        and type(seq) is int
        and _is_int_list(token_ids)
        and type(worker_id) is str
    )
    if not well_typed or index < 0 or seq < 0:
        return None
    return _new_plain_token_event(request_id, index, seq, token_ids, worker_id)


_FIELD_SETTERS = [getattr(TokenEvent, name).__set__ for name in _FIELD_NAMES[TokenEvent]]
_PLAIN_SETTERS = _FIELD_SETTERS[: len(_PLAIN_EVENT_KEYS)]
_PLAIN_DEFAULTS = [
    (setter, field.default)
    for setter, field in zip(_FIELD_SETTERS, dataclasses.fields(TokenEvent), strict=True)
    if field.name not in _PLAIN_EVENT_KEYS
]
assert list(_FIELD_NAMES[TokenEvent][: len(_PLAIN_EVENT_KEYS)]) == _PLAIN_EVENT_KEYS
assert all(value is None or value is False for _, value in _PLAIN_DEFAULTS)


def _new_plain_token_event(request_id: str, index: int, seq: int, token_ids: list[int], worker_id: str) -> TokenEvent:
    """``TokenEvent(request_id, index, seq, token_ids, worker_id)``, its slots set directly: a frozen
    dataclass's ``__init__`` goes through ``object.__setattr__`` once per field and then
    ``__post_init__``, 2.5x the time. Skipping ``__post_init__`` is sound here: every other field keeps
    its default (no logprobs, not finished, no usage or error), which its checks accept whenever
    ``index`` and ``seq`` are not negative (checked by the caller)."""
    event = object.__new__(TokenEvent)
    for setter, value in zip(_PLAIN_SETTERS, (request_id, index, seq, token_ids, worker_id), strict=True):
        setter(event, value)
    for setter, default in _PLAIN_DEFAULTS:
        setter(event, default)
    return event


def _token_event(payload: dict[Any, Any]) -> TokenEvent | None:
    """The ``TokenEvent`` in ``payload`` if it is well formed, else None (the general path decides)."""
    if payload.keys() != _TOKEN_EVENT_KEYS or _exact(payload[_VERSION], int) != TokenEvent.version:
        return None
    usage, finish_reason = payload["usage"], payload["finish_reason"]
    if usage is not None and (usage := _usage(usage)) is None:
        return None
    if finish_reason is not None and (finish_reason := _FINISH_REASONS.get(_exact(finish_reason, str))) is None:
        return None
    logprobs = _floats(payload["logprobs"])
    top_logprobs = _alternatives(payload["top_logprobs"])
    prompt_logprobs = _floats(payload["prompt_logprobs"])
    prompt_top_logprobs = _alternatives(payload["prompt_top_logprobs"])
    well_typed = (
        type(payload["request_id"]) is str
        and type(payload["index"]) is int
        and type(payload["seq"]) is int
        and _is_int_list(payload["token_ids"])
        and type(payload["worker_id"]) is str
        and (logprobs is not None or payload["logprobs"] is None)
        and (top_logprobs is not None or payload["top_logprobs"] is None)
        and (prompt_logprobs is not None or payload["prompt_logprobs"] is None)
        and (prompt_top_logprobs is not None or payload["prompt_top_logprobs"] is None)
        and type(payload["finished"]) is bool
        and (payload["error"] is None or type(payload["error"]) is str)
    )
    if not well_typed:
        return None
    try:
        return TokenEvent(
            request_id=payload["request_id"],
            index=payload["index"],
            seq=payload["seq"],
            token_ids=payload["token_ids"],
            worker_id=payload["worker_id"],
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            finished=payload["finished"],
            finish_reason=finish_reason,
            error=payload["error"],
            usage=usage,
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_top_logprobs,
        )
    except ValueError:  # a broken invariant: the general path words the reason
        return None


def _token_event_group(payload: dict[Any, Any]) -> TokenEventGroup | None:
    """The ``TokenEventGroup`` in ``payload`` if it is well formed (its version, a non-empty array of
    bytes), else None (the general path decides)."""
    if payload.keys() != _TOKEN_GROUP_KEYS or _exact(payload[_VERSION], int) != TokenEventGroup.version:
        return None
    events = payload["events"]
    if type(events) is not list or not events or not all(type(event) is bytes for event in events):
        return None
    return TokenEventGroup(events)


def _exact(value: Any, kind: type) -> Any:
    """``value`` if its type is exactly ``kind`` (``True`` is not an int), else None."""
    return value if type(value) is kind else None


def _is_int_list(value: Any) -> bool:
    return type(value) is list and all(type(item) is int for item in value)


def _floats(value: Any) -> list[float] | None:
    """An array of numbers as floats; None for anything else."""
    if type(value) is not list or not all(type(item) in (float, int) for item in value):
        return None
    return [float(item) for item in value]


def _alternatives(value: Any) -> list[list[tuple[int, float]]] | None:
    """An array of arrays of ``[token_id, logprob]`` pairs as lists of tuples; None for anything else."""
    if type(value) is not list:
        return None
    result = []
    for position in value:
        if type(position) is not list or not all(_is_pair(pair) for pair in position):
            return None
        result.append([(pair[0], float(pair[1])) for pair in position])
    return result


def _is_pair(value: Any) -> bool:
    return type(value) is list and len(value) == 2 and type(value[0]) is int and type(value[1]) in (float, int)


def _usage(value: Any) -> Usage | None:
    if type(value) is not dict or value.keys() != _USAGE_KEYS or not all(type(n) is int for n in value.values()):
        return None
    try:
        return Usage(value["prompt_tokens"], value["completion_tokens"], value["cached_tokens"])
    except ValueError:
        return None


def _message_from(payload: Any) -> Message:
    if not isinstance(payload, dict):
        raise _InvalidPayload(f"payload is a {type(payload).__name__}, not a map")
    kind = payload.get(_KIND)
    cls = _MESSAGE_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise _InvalidPayload(f"unknown message kind {kind!r}")
    version = payload.get(_VERSION)
    if type(version) is not int or version not in _readable_versions(cls):
        raise _InvalidPayload(f"{kind}: unsupported version {version!r} (this codec reads {cls.version})")
    fields = {key: value for key, value in payload.items() if key not in (_KIND, _VERSION)}
    try:
        return _build_dataclass(cls, fields, cls.kind, version)
    except _InvalidPayload:
        raise
    except ValueError as exc:
        raise _InvalidPayload(f"{cls.kind}: {exc}") from exc


def _readable_versions(cls: type[Message]) -> range:
    """The versions of ``cls`` this codec decodes: its own, and those before the fields it added."""
    return _READABLE_VERSIONS[cls.kind]


def _fields_of_version(cls: type, version: int | None) -> dict[str, Any]:
    """The annotated fields a payload of ``version`` carries (every field when ``version`` is None)."""
    hints = _field_hints(cls)
    added: dict[str, int] = dict(getattr(cls, "fields_added", {}))
    if version is None:
        return hints
    return {name: hint for name, hint in hints.items() if added.get(name, 0) <= version}


def _build_dataclass(cls: type, raw: Any, path: str, version: int | None = None) -> Any:
    if not isinstance(raw, dict):
        raise _InvalidPayload(f"{path}: expected a map, got {type(raw).__name__}")
    hints = _fields_of_version(cls, version)
    missing = sorted(name for name in hints if name not in raw)
    unknown = sorted(repr(key) for key in raw if key not in hints)
    if missing:
        raise _InvalidPayload(f"{path}: missing fields {', '.join(missing)}")
    if unknown:
        raise _InvalidPayload(f"{path}: unknown fields {', '.join(unknown)}")
    return cls(**{name: _coerce(raw[name], hint, f"{path}.{name}") for name, hint in hints.items()})


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Check ``value`` (as msgpack decoded it) against ``hint`` and return it in its Python form."""
    origin = typing.get_origin(hint)
    if origin is types.UnionType:
        return _coerce_optional(value, hint, path)
    if origin is list:
        _expect(isinstance(value, list), path, "an array", value)
        (item_hint,) = typing.get_args(hint)
        return [_coerce(item, item_hint, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is tuple:
        item_hints = typing.get_args(hint)
        arity = len(item_hints)
        _expect(isinstance(value, list) and len(value) == arity, path, f"an array of {arity}", value)
        return tuple(
            _coerce(item, h, f"{path}[{i}]") for i, (item, h) in enumerate(zip(value, item_hints, strict=True))
        )
    return _coerce_scalar(value, hint, path)


def _coerce_optional(value: Any, hint: Any, path: str) -> Any:
    arms = [arm for arm in typing.get_args(hint) if arm is not types.NoneType]
    if len(arms) != 1:
        raise TypeError(f"{path}: only 'X | None' unions are supported, not {hint}")
    return None if value is None else _coerce(value, arms[0], path)


def _coerce_scalar(value: Any, hint: Any, path: str) -> Any:
    if hint in (bool, int, str, bytes):
        _expect(type(value) is hint, path, hint.__name__, value)
        return value
    if hint is float:
        _expect(type(value) in (int, float), path, "float", value)
        return float(value)
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        names = [member.value for member in hint]
        _expect(type(value) is str and value in names, path, f"one of {names}", value)
        return hint(value)
    if dataclasses.is_dataclass(hint):
        return _build_dataclass(typing.cast(type, hint), value, path)
    raise TypeError(f"{path}: the codec cannot carry fields annotated {hint!r}")


def _expect(ok: bool, path: str, expected: str, value: Any) -> None:
    if not ok:
        raise _InvalidPayload(f"{path}: expected {expected}, got {_describe(value)}")


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)}"
    if isinstance(value, str):
        return f"str {value[:40]!r}"
    return type(value).__name__
