from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from metrale.shared.replication import Replication
from metrale.shared.settings import (
    DEFAULT_TENANT,
    GatewaySettings,
    KernelBackend,
    TenantLimits,
    WorkerSettings,
    load_settings,
    parse_api_keys,
    tenant_limits,
)

MET_VARIABLES = [
    "MET_REDIS_URL",
    "MET_API_KEYS",
    "MET_NAMESPACE",
    "MET_CHECKPOINT_DIR",
    "MET_KERNELS",
    "MET_HEARTBEAT_TTL_S",
    "MET_REQUEST_TIMEOUT_S",
    "MET_MAX_QUEUE",
    "MET_MAX_QUEUE_WAIT_S",
    "MET_LOG_LEVEL",
    "MET_MODEL_DIR",
    "MET_CACHE_DIR",
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in MET_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


def test_defaults(tmp_path: Path) -> None:
    settings = load_settings()
    assert settings.redis_url is None
    assert settings.api_keys == {}
    assert settings.kernels is KernelBackend.AUTO
    assert settings.heartbeat_ttl_s == 10
    assert settings.cache_dir == tmp_path / ".cache" / "metrale"
    worker = settings.worker()
    assert worker.checkpoint_dir is None  # no directory tier unless MET_CHECKPOINT_DIR is set
    assert worker.model_dir is None
    gateway = settings.gateway()
    assert not gateway.auth_required
    assert gateway.keys.run_record("r") == "met:run:r"


def test_environment_reaches_both_roles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in {
        "MET_REDIS_URL": "redis://cache:6379/2",
        "MET_API_KEYS": "sk-one, sk-two:acme",
        "MET_NAMESPACE": "staging",
        "MET_CHECKPOINT_DIR": "~/ckpt",
        "MET_KERNELS": "triton",
        "MET_HEARTBEAT_TTL_S": "5",
        "MET_REQUEST_TIMEOUT_S": "30.5",
        "MET_MAX_QUEUE": "64",
        "MET_LOG_LEVEL": "debug",
        "MET_MODEL_DIR": "/models/kimi",
    }.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    gateway, worker = settings.gateway(), settings.worker()
    assert gateway.api_keys == {"sk-one": DEFAULT_TENANT, "sk-two": "acme"}
    assert gateway.auth_required
    assert (gateway.redis_url, gateway.request_timeout_s, gateway.max_queue) == (
        "redis://cache:6379/2",
        30.5,
        64,
    )
    assert gateway.keys.cancel_channel() == "staging:cancel"
    assert worker.kernels is KernelBackend.TRITON
    assert worker.checkpoint_dir == tmp_path / "ckpt"
    assert worker.model_dir == Path("/models/kimi")
    assert (worker.heartbeat_ttl_s, worker.log_level) == (5, "DEBUG")


def test_empty_variables_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_REDIS_URL", "")
    monkeypatch.setenv("MET_API_KEYS", "")
    settings = load_settings()
    assert settings.redis_url is None and settings.api_keys == {}


def test_api_keys_are_hidden_from_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_API_KEYS", "sk-secret:acme")
    settings = load_settings()
    assert "sk-secret" not in repr(settings)
    assert "sk-secret" not in repr(settings.gateway())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("k1", {"k1": DEFAULT_TENANT}, id="bare-key"),
        pytest.param("k1:acme,k2", {"k1": "acme", "k2": DEFAULT_TENANT}, id="mixed"),
        pytest.param(" k1 : ,, k2:b ", {"k1": DEFAULT_TENANT, "k2": "b"}, id="blank-entries-skipped"),
        pytest.param("k1:acme:4:60000", {"k1": "acme"}, id="with-limits"),
    ],
)
def test_parse_api_keys(text: str, expected: dict[str, str]) -> None:
    assert {key: entry.tenant for key, entry in parse_api_keys(text).items()} == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("k1:acme:4:60000", {"acme": TenantLimits(4, 60000)}, id="both"),
        pytest.param("k1:acme:4", {"acme": TenantLimits(4, None)}, id="concurrency-only"),
        pytest.param("k1:acme::500", {"acme": TenantLimits(None, 500)}, id="tokens-only"),
        pytest.param("k1:acme::", {}, id="empty-means-unlimited"),
        pytest.param("k1:acme:2,k2:acme", {"acme": TenantLimits(2, None)}, id="given-on-one-key"),
        pytest.param("k1::3", {DEFAULT_TENANT: TenantLimits(3, None)}, id="default-tenant"),
    ],
)
def test_tenant_limits_from_api_keys(text: str, expected: dict[str, TenantLimits]) -> None:
    assert tenant_limits(parse_api_keys(text)) == expected


def test_tenant_limits_reach_the_gateway_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_API_KEYS", "sk-a:acme:2:1000,sk-b:beta")
    monkeypatch.setenv("MET_MAX_QUEUE_WAIT_S", "5")
    gateway = load_settings().gateway()
    assert gateway.api_keys == {"sk-a": "acme", "sk-b": "beta"}
    assert gateway.tenant_limits == {"acme": TenantLimits(2, 1000)}
    assert gateway.max_queue_wait_s == 5.0


@pytest.mark.parametrize(
    "text",
    ["k1,k1:acme", ":acme", "k1:a:0", "k1:a:x", "k1:a:1:2:3", "k1:a:1,k2:a:2"],
    ids=["duplicate", "empty-key", "zero-limit", "not-a-number", "too-many-parts", "conflicting-limits"],
)
def test_parse_api_keys_rejects_without_echoing_the_secret(text: str) -> None:
    with pytest.raises(ValueError, match="entry") as caught:
        parse_api_keys(text)
    assert "k1" not in str(caught.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("MET_KERNELS", "cuda", id="unknown-kernels"),
        pytest.param("MET_HEARTBEAT_TTL_S", "soon", id="non-numeric-ttl"),
        pytest.param("MET_LOG_LEVEL", "chatty", id="unknown-log-level"),
        pytest.param("MET_API_KEYS", "k1,k1", id="duplicate-key"),
    ],
)
def test_bad_values_fail_at_load(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(pydantic.ValidationError):
        load_settings()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        pytest.param("MET_REDIS_URL", "localhost:6379", "redis_url", id="url-without-scheme"),
        pytest.param("MET_HEARTBEAT_TTL_S", "0", "heartbeat_ttl_s", id="zero-ttl"),
        pytest.param("MET_MAX_QUEUE", "0", "max_queue", id="zero-queue"),
        pytest.param("MET_REQUEST_TIMEOUT_S", "-1", "request_timeout_s", id="negative-timeout"),
        pytest.param("MET_API_KEYS", "k1:ac me", "invalid tenant", id="tenant-with-space"),
        pytest.param("MET_API_KEYS", "k1:acme:corp", "whole numbers", id="limit-not-a-number"),
        pytest.param("MET_MAX_QUEUE_WAIT_S", "0", "max_queue_wait_s", id="zero-wait-bound"),
        pytest.param("MET_NAMESPACE", "a b", "invalid namespace", id="bad-namespace"),
        pytest.param("MET_REDIS_URL", "redis+sentinel://s1:26379", "names its service", id="sentinels-no-service"),
        pytest.param("MET_REDIS_URL", "redis://h?ssl_ca_certs=/ca.pem", "need TLS", id="tls-option-without-tls"),
        pytest.param("MET_REDIS_WAIT_REPLICAS", "-1", "redis_wait_replicas", id="negative-replicas"),
        pytest.param("MET_REDIS_WAIT_TIMEOUT_MS", "0", "redis_wait_timeout_ms", id="zero-wait"),
    ],
)
def test_gateway_role_validates_its_settings(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        load_settings().gateway()


def worker_settings(tmp_path: Path, *, redis_url: str | None = None, heartbeat_ttl_s: int = 1) -> WorkerSettings:
    return WorkerSettings(
        redis_url=redis_url,
        model_dir=None,
        checkpoint_dir=tmp_path / "ckpt",
        kernels=KernelBackend.TORCH,
        heartbeat_ttl_s=heartbeat_ttl_s,
    )


def test_worker_role_validates_its_settings(tmp_path: Path) -> None:
    assert worker_settings(tmp_path).keys.namespace == "met"
    with pytest.raises(ValueError, match="heartbeat_ttl_s"):
        worker_settings(tmp_path, heartbeat_ttl_s=0)
    with pytest.raises(ValueError, match="redis_url"):
        worker_settings(tmp_path, redis_url="http://x")


def test_role_settings_are_frozen() -> None:
    gateway = GatewaySettings(None, {}, request_timeout_s=1.0, max_queue=1, heartbeat_ttl_s=1)
    with pytest.raises(AttributeError):
        gateway.max_queue = 2  # type: ignore[misc]


def test_stored_responses_expire_after_the_configured_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MET_RESPONSE_TTL_S", raising=False)
    assert load_settings().gateway().response_ttl_s == 30 * 24 * 3600
    monkeypatch.setenv("MET_RESPONSE_TTL_S", "120")
    assert load_settings().gateway().response_ttl_s == 120
    monkeypatch.setenv("MET_RESPONSE_TTL_S", "0")
    with pytest.raises(ValueError, match="response_ttl_s"):
        load_settings().gateway()


def test_replicas_to_wait_for_reach_both_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_REDIS_URL", "rediss+sentinel://met:pw@s1,s2:26380,s3/metrale/2?ssl_ca_certs=/ca.pem")
    monkeypatch.setenv("MET_REDIS_WAIT_REPLICAS", "1")
    monkeypatch.setenv("MET_REDIS_WAIT_TIMEOUT_MS", "250")
    settings = load_settings()
    assert settings.gateway().replication == settings.worker().replication == Replication(1, 250)
    monkeypatch.delenv("MET_REDIS_WAIT_REPLICAS")
    assert load_settings().worker().replication == Replication(0, 250)
