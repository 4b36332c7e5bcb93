"""A malformed entry on the request stream is moved to the dead-letter stream, and the worker process
keeps serving: the next request through the gateway gets its exact greedy answer."""

from __future__ import annotations

from typing import cast

import httpx
import pytest
import redis

from metrale.shared.codec import encode
from metrale.shared.keys import WORKER_GROUP
from metrale.shared.messages import CancelRequest, GenerateRequest, Priority
from metrale.worker.engine.factory import LoadedModel
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.builtin import RANDOM_MODEL_NAME
from tests.integration.deployments import Fleet
from tests.integration.polling import wait_for
from tests.integration.reference import offline_choices, token_texts

pytestmark = [pytest.mark.slow, pytest.mark.redis]

PROMPT = [21, 22, 23, 24, 25]

A_CANCEL = encode(CancelRequest("cmpl-x", "not a request"))
A_REQUEST_ID_WITH_A_COLON = encode(GenerateRequest("cmpl-a:b", RANDOM_MODEL_NAME, "default", [1, 2], max_tokens=4))
GARBAGE = [
    pytest.param({"msg": b"\x00\xff not msgpack"}, "", id="not-msgpack"),
    pytest.param({"payload": b"hello"}, "no 'msg' field", id="no-msg-field"),
    pytest.param({"msg": A_CANCEL}, "expected a 'generate' message", id="a-cancel"),
    pytest.param({"msg": A_REQUEST_ID_WITH_A_COLON}, "invalid request id", id="request-id-with-a-colon"),
]


@pytest.mark.parametrize(("fields", "reason_part"), GARBAGE)
def test_a_garbage_entry_is_dead_lettered_and_the_worker_keeps_serving(
    fleet: Fleet,
    fleet_redis: redis.Redis,
    reference_model: LoadedModel,
    fields: dict[str, bytes],
    reason_part: str,
) -> None:
    stream = fleet.keys.request_stream(Priority.INTERACTIVE)
    entry_id = cast(bytes, fleet_redis.xadd(stream, fields)).decode()  # type: ignore[arg-type]  # stub: str values

    dead = _dead_letter_of(fleet_redis, fleet, entry_id)
    assert dead[b"stream"].decode() == stream and dead[b"raw"] == fields.get("msg", b"")
    assert dead[b"reason"] and reason_part in dead[b"reason"].decode()
    assert fleet_redis.xrange(stream, min=entry_id, max=entry_id) == []
    assert fleet_redis.xpending_range(stream, WORKER_GROUP, min=entry_id, max=entry_id, count=1) == []

    answer = _greedy_completion_tokens(fleet, max_tokens=6)
    (expected,) = offline_choices(reference_model, PROMPT, SamplingParams(max_tokens=6, temperature=0))
    assert answer == token_texts(reference_model, expected.token_ids)
    assert fleet.worker.popen.poll() is None


def _dead_letter_of(client: redis.Redis, fleet: Fleet, entry_id: str) -> dict[bytes, bytes]:
    """The dead-letter entry that set aside request-stream entry ``entry_id``."""

    def probe() -> dict[bytes, bytes] | None:
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(fleet.keys.dead_letter()))
        return next((dead for _, dead in entries if dead[b"entry_id"].decode() == entry_id), None)

    return wait_for(probe, f"entry {entry_id} to be dead-lettered")


def _greedy_completion_tokens(fleet: Fleet, *, max_tokens: int) -> list[str]:
    body = {"model": fleet.endpoint.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    body |= {"logprobs": 0}
    response = httpx.post(
        f"{fleet.endpoint.base_url}/v1/completions", json=body, headers=fleet.endpoint.headers, timeout=30
    )
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["logprobs"]["tokens"])
