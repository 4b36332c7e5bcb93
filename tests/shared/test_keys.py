from __future__ import annotations

import fnmatch
from collections.abc import Callable

import pytest

from metrale.shared.keys import DEFAULT_KEYS, WORKER_GROUP, Keys, check_segment
from metrale.shared.messages import Priority

KEYS = Keys()


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        pytest.param(lambda k: k.request_stream(Priority.INTERACTIVE), "met:req:interactive", id="stream-interactive"),
        pytest.param(lambda k: k.request_stream(Priority.BATCH), "met:req:batch", id="stream-batch"),
        pytest.param(lambda k: k.token_channel("r-1"), "met:out:r-1", id="token-channel"),
        pytest.param(lambda k: k.run_record("r-1"), "met:run:r-1", id="run-record"),
        pytest.param(lambda k: k.run_events("r-1"), "met:run:r-1:events", id="run-events"),
        pytest.param(lambda k: k.cancel_channel(), "met:cancel", id="cancel-channel"),
        pytest.param(lambda k: k.worker("gpu-0"), "met:worker:gpu-0", id="worker"),
        pytest.param(lambda k: k.model("moonshotai/Kimi-Linear"), "met:model:moonshotai/Kimi-Linear", id="model"),
        pytest.param(lambda k: k.checkpoint("fp1", "acme", "ab12"), "met:ckpt:fp1:acme:ab12", id="checkpoint"),
        pytest.param(lambda k: k.session("acme", "s.1"), "met:session:acme:s.1", id="session"),
        pytest.param(lambda k: k.dead_letter(), "met:dead", id="dead-letter"),
        pytest.param(lambda k: k.worker_index(), "met:workers", id="worker-index"),
        pytest.param(lambda k: k.control_channel("gpu-0"), "met:control:gpu-0", id="control-channel"),
        pytest.param(lambda k: k.running_index(), "met:running", id="running-index"),
        pytest.param(lambda k: k.running_info(), "met:running:info", id="running-info"),
        pytest.param(lambda k: k.active_batches(), "met:active-batches", id="active-batches"),
        pytest.param(lambda k: k.gateway_counters(), "met:metrics:gateway", id="gateway-counters"),
    ],
)
def test_keys_follow_the_design_table(build: Callable[[Keys], str], expected: str) -> None:
    assert build(KEYS) == expected
    assert build(Keys("test7")) == "test7" + expected.removeprefix("met")


def test_defaults() -> None:
    assert DEFAULT_KEYS.namespace == "met"
    assert WORKER_GROUP == "workers"


def test_request_stream_accepts_the_plain_priority_string() -> None:
    assert KEYS.request_stream("batch") == "met:req:batch"  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        KEYS.request_stream("urgent")  # type: ignore[arg-type]


def test_scan_patterns_match_exactly_their_own_keys() -> None:
    others = [KEYS.model("tiny"), KEYS.run_record("r"), Keys("other").worker("w-1"), KEYS.session("t", "s")]
    assert fnmatch.fnmatchcase(KEYS.worker("w-1"), KEYS.worker_pattern())
    assert fnmatch.fnmatchcase(KEYS.model("org/tiny"), KEYS.model_pattern())
    assert not any(fnmatch.fnmatchcase(key, KEYS.worker_pattern()) for key in others)
    assert not fnmatch.fnmatchcase(KEYS.worker("w-1"), KEYS.model_pattern())


@pytest.mark.parametrize(
    "bad",
    ["", "a:b", "a b", "tab\there", "new\nline", "star*", "what?", "[set]", "back\\slash", "ü", "x" * 257],
    ids=[
        "empty",
        "colon",
        "space",
        "tab",
        "newline",
        "star",
        "question",
        "brackets",
        "backslash",
        "non-ascii",
        "too-long",
    ],
)
def test_ids_that_would_break_a_key_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant"):
        check_segment(bad, "tenant")
    with pytest.raises(ValueError, match="invalid session id"):
        KEYS.session("acme", bad)


def test_a_colon_cannot_move_a_key_into_another_tenant() -> None:
    # Were ':' allowed, tenant "a:b" + session "c" and tenant "a" + session "b:c" would share a key.
    with pytest.raises(ValueError, match="tenant"):
        KEYS.session("a:b", "c")
    with pytest.raises(ValueError, match="session id"):
        KEYS.session("a", "b:c")


@pytest.mark.parametrize(
    ("build", "what"),
    [
        pytest.param(lambda: KEYS.token_channel("r:1"), "request id", id="request-id"),
        pytest.param(lambda: KEYS.run_events("r:1"), "request id", id="run-events"),
        pytest.param(lambda: KEYS.worker("w:1"), "worker id", id="worker-id"),
        pytest.param(lambda: KEYS.model("m:1"), "model name", id="model-name"),
        pytest.param(lambda: KEYS.checkpoint("f:1", "t", "h"), "model fingerprint", id="fingerprint"),
        pytest.param(lambda: KEYS.checkpoint("f", "t", "h*"), "token hash", id="token-hash"),
        pytest.param(lambda: Keys("met:x"), "namespace", id="namespace"),
    ],
)
def test_every_id_in_a_key_is_checked(build: Callable[[], object], what: str) -> None:
    with pytest.raises(ValueError, match=f"invalid {what}"):
        build()


def test_ids_of_every_allowed_character_pass() -> None:
    ident = "Az09._-/@+="
    assert check_segment(ident, "id") == ident
    assert check_segment("x" * 256, "id") == "x" * 256
