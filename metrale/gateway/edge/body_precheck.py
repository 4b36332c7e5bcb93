"""Request bodies of many JSON values judged in a process of their own before the gateway parses them.

Parsing JSON builds Python objects with the interpreter lock held (``json``, pydantic-core): no other
thread runs meanwhile, so moving the parse to a thread frees nothing. 3 MB of tools held the event loop
(and ``/health``) 0.6 s on these machines, 1 MB of stop strings 75–150 ms. What costs is the number of
values, not the bytes (an 8 MB prompt is one string, parsed in milliseconds), and it is bounded from the
raw bytes in C time: every string brings two quotes, every object and array a bracket
(``node_bound``). A body that may hold more than ``INLINE_NODES`` is therefore first parsed and judged
in a separate process (one, started with the gateway and again if it dies): validated against its
schema, checked against the request limits (``request_limits.py``) for a generation request, and its
JSON nodes counted (``max_body_nodes``). A refusal comes back as the error the gateway itself would
raise, and the body is never parsed here; only a body that passed is — and passing bounds that parse.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pydantic import BaseModel, ValidationError

from metrale.shared import errors
from metrale.shared.errors import BadRequest, MetraleError
from metrale.shared.settings import RequestLimits

INLINE_NODES = 16_384
"""Bodies that may hold more strings, objects and arrays than this are judged in the pre-check process
before they are parsed here (fewer parse in a few ms)."""


def node_bound(raw: bytes) -> int:
    """An upper bound on the strings, objects and arrays of the JSON text ``raw`` (keys are strings;
    quotes and brackets inside strings only raise it), counted in C without parsing."""
    return raw.count(b'"') // 2 + raw.count(b"{") + raw.count(b"[")


Refusal = tuple[str, str, str | None]
"""A refusal as it crosses the process boundary: the error class's name in ``shared/errors.py``, its
message and its ``param``."""


class BodyPrecheck:
    """The pre-check process of one gateway, started on first use and replaced if it dies."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def judge(self, raw: bytes, schema: type[BaseModel], limits: RequestLimits) -> None:
        """Raise what parsing ``raw`` as ``schema`` (and, for a generation request, the request
        limits) would raise, judged in the pre-check process; return when the body passes."""
        loop = asyncio.get_running_loop()
        try:
            refusal = await loop.run_in_executor(self._executor(), judge_body, raw, schema, limits)
        except BrokenProcessPool:
            self._pool = None  # killed (e.g. out of memory on a huge body): the next body gets a new one
            raise BadRequest("The request body could not be parsed.") from None
        if refusal is not None:
            raise _rebuild(refusal)

    def start(self) -> None:
        """Start the process now and have it import what it judges with, so that the first large body
        does not wait for that (a few seconds on two busy cores)."""
        self._executor().submit(_import_judges)

    def close(self) -> None:
        """Stop the pre-check process, if it was started."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return self._pool


def _import_judges() -> None:
    import metrale.gateway.edge.body
    import metrale.gateway.request_limits  # noqa: F401


def judge_body(raw: bytes, schema: type[BaseModel], limits: RequestLimits) -> Refusal | None:
    """In the pre-check process: the refusal ``raw`` earns as ``schema`` under ``limits``, or None."""
    from metrale.gateway.edge.body import invalid_body
    from metrale.gateway.request_bodies import SamplingFields
    from metrale.gateway.request_limits import check_request_limits

    try:
        try:
            body = schema.model_validate_json(raw)
        except ValidationError as error:
            raise invalid_body(error.errors(include_url=False)) from None
        if isinstance(body, SamplingFields):
            check_request_limits(body, limits)
        check_body_nodes(json.loads(raw), limits.max_body_nodes)
    except MetraleError as refusal:
        return type(refusal).__name__, refusal.message, refusal.param
    return None


def check_body_nodes(document: Any, limit: int) -> None:
    """Refuse a parsed JSON ``document`` of more than ``limit`` strings, arrays and objects (numbers,
    booleans and nulls are not counted: a prompt of token ids is one array)."""
    pending = [document]
    nodes = 0
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            nodes += 1 + len(value)  # the object and its keys
            pending.extend(value.values())
        elif isinstance(value, list):
            nodes += 1
            pending.extend(item for item in value if isinstance(item, (dict, list, str)))
        elif isinstance(value, str):
            nodes += 1
        if nodes > limit:
            raise BadRequest(
                f"The request body holds more than {limit} JSON strings, arrays and objects (MET_MAX_BODY_NODES)."
            )


def _rebuild(refusal: Refusal) -> MetraleError:
    name, message, param = refusal
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, MetraleError):
        try:
            return kind(message, param=param)
        except TypeError:  # an error class with a constructor of its own
            pass
    return BadRequest(message, param=param)
