"""The versioned msgpack codec for every message in ``messages``.

Wire layout: one msgpack map holding ``kind`` (the message class), ``v`` (that class's ``version``)
and every dataclass field by name. Enum members travel as their string value, tuples and lists as
arrays, nested dataclasses (``Usage``) as maps.

``decode`` never raises on bad input. Garbage bytes, an unknown kind, another version, a missing,
unknown or wrongly-typed field, or a broken message invariant all come back as a ``DecodeError``,
which the worker moves to the dead-letter stream. Field types are checked against each dataclass
annotation exactly: ``True`` is not an int, an int is accepted (and widened) where a float is due,
and a payload must carry every field, including those that have defaults in Python.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

import msgpack

from metrale.shared.messages import MESSAGE_TYPES, Message

_KIND = "kind"
_VERSION = "v"
_MESSAGE_CLASSES: dict[str, type[Message]] = {cls.kind: cls for cls in MESSAGE_TYPES}


@dataclass(frozen=True, slots=True)
class DecodeError:
    """Why a payload could not be decoded; ``size`` is the payload's length in bytes."""

    reason: str
    size: int


class _InvalidPayload(ValueError):
    """A payload that does not match its message's schema."""


def encode(message: Message) -> bytes:
    """Serialize ``message`` with its kind and version; the inverse of ``decode``."""
    payload: dict[str, Any] = {_KIND: message.kind, _VERSION: message.version}
    payload.update(_to_wire(message))
    packed: bytes = msgpack.packb(payload, use_bin_type=True)
    return packed


def decode(data: bytes) -> Message | DecodeError:
    """Parse one payload written by ``encode``; never raises, bad input yields a ``DecodeError``."""
    try:
        payload = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        return DecodeError(f"not a msgpack payload ({type(exc).__name__}: {exc})", len(data))
    try:
        return _message_from(payload)
    except ValueError as exc:  # _InvalidPayload, or an invariant broken in __post_init__
        return DecodeError(str(exc), len(data))


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [_to_wire(item) for item in value]
    return value


def _message_from(payload: Any) -> Message:
    if not isinstance(payload, dict):
        raise _InvalidPayload(f"payload is a {type(payload).__name__}, not a map")
    kind = payload.get(_KIND)
    cls = _MESSAGE_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise _InvalidPayload(f"unknown message kind {kind!r}")
    version = payload.get(_VERSION)
    if type(version) is not int or version != cls.version:
        raise _InvalidPayload(f"{kind}: unsupported version {version!r} (this codec reads {cls.version})")
    fields = {key: value for key, value in payload.items() if key not in (_KIND, _VERSION)}
    try:
        return _build_dataclass(cls, fields, cls.kind)
    except _InvalidPayload:
        raise
    except ValueError as exc:
        raise _InvalidPayload(f"{cls.kind}: {exc}") from exc


def _build_dataclass(cls: type, raw: Any, path: str) -> Any:
    if not isinstance(raw, dict):
        raise _InvalidPayload(f"{path}: expected a map, got {type(raw).__name__}")
    hints = _field_hints(cls)
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
    if hint in (bool, int, str):
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
