"""Large bodies judged in the pre-check process: the same refusals the gateway gives, and an event loop
that keeps turning while a body that would take it most of a second to parse is judged."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from metrale.gateway.edge.body_precheck import INLINE_NODES, BodyPrecheck, check_body_nodes, judge_body, node_bound
from metrale.gateway.request_bodies import ChatCompletionRequest
from metrale.shared.errors import BadRequest, InvalidBody
from metrale.shared.settings import RequestLimits

LIMITS = RequestLimits()


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _tools(count: int) -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    return [{"type": "function", "function": {"name": f"t{i}", "parameters": schema}} for i in range(count)]


@pytest.fixture(scope="module")
def precheck() -> Iterator[BodyPrecheck]:
    checker = BodyPrecheck()
    yield checker
    checker.close()


def test_a_body_within_every_limit_passes() -> None:
    assert judge_body(_chat(stop=["a", "b"], tools=_tools(3)), ChatCompletionRequest, LIMITS) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(stop=[f"s{i}" for i in range(80_000)]), "stop"),
        (_chat(tools=_tools(200)), "tools"),
        (_chat(temperature="hot"), "temperature"),
    ],
    ids=["stop-strings", "tools", "wrong-type"],
)
def test_refusals_are_the_gateways_own(body: bytes, param: str) -> None:
    refusal = judge_body(body, ChatCompletionRequest, LIMITS)
    assert refusal is not None
    kind, _, named = refusal
    assert kind in {BadRequest.__name__, InvalidBody.__name__}
    assert named == param


def test_nodes_are_strings_arrays_and_objects() -> None:
    check_body_nodes({"prompt": list(range(100_000))}, limit=3)  # numbers are free
    with pytest.raises(BadRequest, match="MET_MAX_BODY_NODES"):
        check_body_nodes({"a": ["x", "y"], "b": {"c": "d"}}, limit=8)
    check_body_nodes({"a": ["x", "y"], "b": {"c": "d"}}, limit=9)  # 2 objects, 3 keys, 1 array, 3 strings


def test_the_refusal_is_raised_as_its_own_class(precheck: BodyPrecheck) -> None:
    with pytest.raises(BadRequest) as refused:
        asyncio.run(precheck.judge(_chat(stop=[f"s{i}" for i in range(1000)]), ChatCompletionRequest, LIMITS))
    assert refused.value.param == "stop"


def test_the_event_loop_turns_while_a_huge_body_is_judged(precheck: BodyPrecheck) -> None:
    """25,000 tools (3 MB): parsing them here held the loop ~0.6 s; judged elsewhere, it is free."""
    body = _chat(tools=_tools(25_000))

    async def judged_with_loop_lag() -> float:
        await precheck.judge(_chat(), ChatCompletionRequest, LIMITS)  # the process is up
        worst = 0.0

        async def tick() -> None:
            nonlocal worst
            while True:
                started = time.perf_counter()
                await asyncio.sleep(0.005)
                worst = max(worst, time.perf_counter() - started - 0.005)

        ticking = asyncio.create_task(tick())
        with pytest.raises(BadRequest, match="tools"):
            await precheck.judge(body, ChatCompletionRequest, LIMITS)
        ticking.cancel()
        return worst

    assert asyncio.run(judged_with_loop_lag()) < 0.1


@pytest.mark.parametrize(
    "document",
    [
        {"prompt": "x" * 8_000_000},
        {"stop": [f"s{i}" for i in range(1000)], "tools": _tools(20)},
        {"a": ['quo"te', "{[", {"b": [1, 2, {"c": None}]}]},
    ],
    ids=["one-long-string", "many-values", "brackets-in-strings"],
)
def test_the_node_bound_is_never_below_the_nodes(document: dict[str, Any]) -> None:
    raw = json.dumps(document).encode()
    counted = 0
    while True:  # the exact count: the smallest limit check_body_nodes lets pass
        try:
            check_body_nodes(document, counted)
            break
        except BadRequest:
            counted += 1
    assert counted <= node_bound(raw)


def test_a_long_prompt_is_parsed_in_place_and_many_values_are_not() -> None:
    assert node_bound(_chat(messages=[{"role": "user", "content": "x" * 8_000_000}])) < INLINE_NODES
    assert node_bound(_chat(stop=[f"s{i}" for i in range(INLINE_NODES)])) > INLINE_NODES
