"""Whether some finite JSON value satisfies a JSON schema: a static check before a schema constrains
decoding.

A schema that admits no finite value (a required property whose schema is itself unsatisfiable, a
``$ref`` cycle with no way out, ``enum: []``, ``not: {}``, ...) would leave a constrained decode with
no token to take once it is in there; it is refused up front instead.

The check is a least fixpoint over the schema graph: the nodes are the root and every local ``$ref``
target; no node is known satisfiable at first, and a node becomes so once its own keywords are
satisfiable given the ``$ref`` targets known so far, until nothing changes. A cycle with no way out
thus never becomes satisfiable, while a recursive schema that can stop (an optional child, an empty
list of children) does. Inline subschemas are judged where they stand (a tree, no cycles).

The check is conservative: it answers False only when it is sure. Keywords it does not reason about
(``if``/``then``/``else``, ``not`` other than ``not: {}``, numeric and string bounds, patterns,
``$ref`` s it cannot resolve, such as anchors or remote documents) count as satisfiable.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote

Schema = Mapping[str, Any] | bool

_SCALAR_TYPES = frozenset({"null", "boolean", "number", "integer", "string"})
_SUBSCHEMA_MAPS = ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else")


def admits_finite_value(schema: Schema) -> bool:
    """Whether some finite JSON value satisfies ``schema`` (False only when surely none does)."""
    try:
        return _Fixpoint(schema).root_satisfiable()
    except RecursionError:  # nested deeper than Python recurses: no verdict, so no refusal
        return True


class _Fixpoint:
    def __init__(self, root: Schema) -> None:
        self._root = root
        self._known: set[int] = set()  # ids of the $ref targets known satisfiable

    def root_satisfiable(self) -> bool:
        targets = {id(target): target for target in self._ref_targets(self._root)}
        changed = True
        while changed:
            changed = False
            for key, target in targets.items():
                if key not in self._known and self._satisfiable(target):
                    self._known.add(key)
                    changed = True
        return self._satisfiable(self._root)

    def _ref_targets(self, schema: Schema) -> Iterator[Schema]:
        for node in _walk(schema):
            ref = node.get("$ref")
            if isinstance(ref, str):
                target = self._resolve(ref)
                if target is not None:
                    yield target

    def _resolve(self, ref: str) -> Schema | None:
        """The local target of ``ref`` (``#`` or a JSON pointer ``#/...``); None for anything else."""
        if not ref.startswith("#") or (len(ref) > 1 and not ref.startswith("#/")):
            return None
        node: Any = self._root
        for token in ref[2:].split("/") if len(ref) > 1 else []:
            step = unquote(token).replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and step in node:
                node = node[step]
            elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
                node = node[int(step)]
            else:
                return None
        return node if isinstance(node, Mapping | bool) else None

    def _satisfiable(self, schema: Any) -> bool:
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, Mapping):
            return True  # not a schema: llguidance judges it
        return (
            self._ref_satisfiable(schema)
            and all(self._satisfiable(branch) for branch in _list(schema, "allOf"))
            and _any_or_absent(self._satisfiable, schema, "anyOf")
            and _any_or_absent(self._satisfiable, schema, "oneOf")
            and schema.get("not") not in ({}, True)
            and self._own_keywords_satisfiable(schema)
        )

    def _ref_satisfiable(self, schema: Mapping[str, Any]) -> bool:
        ref = schema.get("$ref")
        if not isinstance(ref, str):
            return True
        target = self._resolve(ref)
        return target is None or id(target) in self._known

    def _own_keywords_satisfiable(self, schema: Mapping[str, Any]) -> bool:
        if "const" in schema:
            return True
        if "enum" in schema:
            return not isinstance(schema["enum"], list) or len(schema["enum"]) > 0
        types = schema.get("type")
        if not isinstance(types, str | list):
            return True  # any kind of value: a scalar needs nothing of the object or array keywords
        kinds = [types] if isinstance(types, str) else types
        return any(
            kind in _SCALAR_TYPES
            or (kind == "object" and self._object_satisfiable(schema))
            or (kind == "array" and self._array_satisfiable(schema))
            or kind not in ("object", "array")
            for kind in kinds
        )

    def _object_satisfiable(self, schema: Mapping[str, Any]) -> bool:
        properties = _map(schema, "properties")
        extra = schema.get("additionalProperties", True)
        required = [name for name in _list(schema, "required") if isinstance(name, str)]
        for name in required:
            if name in properties:
                if not self._satisfiable(properties[name]):
                    return False
            elif not _map(schema, "patternProperties") and not self._satisfiable(extra):
                return False
        fewest = schema.get("minProperties", 0)
        if isinstance(fewest, int) and fewest > len(set(required)):
            optional = [s for name, s in properties.items() if name not in required]
            if not (_map(schema, "patternProperties") or self._satisfiable(extra)):
                return sum(1 for s in optional if self._satisfiable(s)) >= fewest - len(set(required))
        return True

    def _array_satisfiable(self, schema: Mapping[str, Any]) -> bool:
        fewest = schema.get("minItems", 0)
        if not isinstance(fewest, int) or fewest <= 0:
            return True
        items = schema.get("items", True)
        if isinstance(items, list):  # draft 7's tuple form
            prefix, rest = items, schema.get("additionalItems", True)
        else:
            prefix, rest = _list(schema, "prefixItems"), items
        if not all(self._satisfiable(item) for item in prefix[:fewest]):
            return False
        return fewest <= len(prefix) or self._satisfiable(rest)


def _walk(schema: Any) -> Iterator[Mapping[str, Any]]:
    """Every subschema object of ``schema`` (itself included), without following ``$ref``."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, Mapping):
            continue
        yield node
        for name in _SUBSCHEMA_MAPS:
            pending += _map(node, name).values()
        for name in _SUBSCHEMA_LISTS:
            pending += _list(node, name)
        pending += [node[name] for name in _SUBSCHEMAS if name in node]
        items = node.get("items")
        if isinstance(items, list):
            pending += items


def _any_or_absent(satisfiable: Any, schema: Mapping[str, Any], keyword: str) -> bool:
    if keyword not in schema:
        return True
    return any(satisfiable(branch) for branch in _list(schema, keyword))


def _list(schema: Mapping[str, Any], keyword: str) -> list[Any]:
    value = schema.get(keyword)
    return value if isinstance(value, list) else []


def _map(schema: Mapping[str, Any], keyword: str) -> Mapping[str, Any]:
    value = schema.get(keyword)
    return value if isinstance(value, Mapping) else {}
