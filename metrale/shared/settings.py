"""Configuration: the only module that reads environment variables (all prefixed ``MET_``).

``load_settings()`` reads the environment into ``MetraleSettings``; each process role then takes
its own frozen dataclass from it (``.gateway()``, ``.worker()``), which checks its invariants in
``__post_init__`` and is what the rest of the code receives. Tests may build those dataclasses
directly.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from metrale.shared.keys import DEFAULT_NAMESPACE, Keys, check_segment
from metrale.shared.redis_url import parse_redis_url
from metrale.shared.replication import NO_WAIT, Replication

DEFAULT_TENANT = "default"
MAX_FILE_BYTES = 200 * 1024 * 1024
"""OpenAI's limit on one uploaded file: 200 MB."""
MAX_FILE_LINES = 50_000
"""OpenAI's limit on the requests of one batch input file."""
"""The tenant of an API key configured without one, and of every request when auth is off."""

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class KernelBackend(StrEnum):
    """Which kernel implementations a worker runs; ``auto`` picks Triton on CUDA and C kernels on the CPU."""

    TORCH = "torch"
    NATIVE = "native"
    TRITON = "triton"
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """What one tenant may use across the fleet: requests in flight at once (``max_concurrent``) and
    tokens per minute (``tokens_per_min``: prompt plus requested output tokens). None: unlimited."""

    max_concurrent: int | None = None
    tokens_per_min: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_concurrent is None or self.max_concurrent >= 1, "max_concurrent must be >= 1")
        _check(self.tokens_per_min is None or self.tokens_per_min >= 1, "tokens_per_min must be >= 1")

    @property
    def unlimited(self) -> bool:
        """Whether neither limit is set."""
        return self.max_concurrent is None and self.tokens_per_min is None


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One entry of ``MET_API_KEYS``: the tenant a key belongs to and that tenant's limits."""

    tenant: str = DEFAULT_TENANT
    limits: TenantLimits = field(default_factory=TenantLimits)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one HTTP connection to the gateway may hold (``gateway/edge/http_server.py``): its request line
    and headers must arrive within ``header_timeout_s`` (``MET_HTTP_HEADER_TIMEOUT_S``), a body may
    stall at most ``body_timeout_s`` between reads (``MET_HTTP_BODY_TIMEOUT_S``), an idle keep-alive
    connection is closed after ``keep_alive_s`` (``MET_HTTP_KEEP_ALIVE_S``), and at most
    ``max_connections`` are open at once (``MET_HTTP_MAX_CONNECTIONS``; at the cap a new one closes
    the oldest that is not in a request, else is refused)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5
    max_connections: int = 10_000

    def __post_init__(self) -> None:
        _check(self.header_timeout_s > 0, "http header_timeout_s must be > 0")
        _check(self.body_timeout_s > 0, "http body_timeout_s must be > 0")
        _check(self.keep_alive_s >= 1, "http keep_alive_s must be >= 1")
        _check(self.max_connections >= 1, "http max_connections must be >= 1")


RESPONSE_TTL_S = 30 * 24 * 3600
"""Stored Responses API responses live 30 days by default, as OpenAI keeps them."""
BATCH_FILE_TTL_S = 30 * 24 * 3600
"""Uploads with ``purpose=batch`` expire after 30 days unless ``expires_after`` says otherwise, as OpenAI's do."""
TENANT_MAX_FILES = 10_000
TENANT_MAX_FILE_BYTES = 10 * 1024**3
TENANT_MAX_STORED_RESPONSES = 100_000


@dataclass(frozen=True, slots=True)
class StorageQuotas:
    """What one tenant may keep: ``max_files`` files of at most ``max_file_bytes`` bytes together
    (``MET_TENANT_MAX_FILES``, ``MET_TENANT_MAX_FILE_BYTES``; a batch's output files count but are
    never refused) and ``max_stored_responses`` stored responses (``MET_TENANT_MAX_STORED_RESPONSES``).
    0 means unlimited. ``batch_file_ttl_s`` (``MET_BATCH_FILE_TTL_S``; 0: never) is when a batch
    upload without ``expires_after`` expires."""

    max_files: int = TENANT_MAX_FILES
    max_file_bytes: int = TENANT_MAX_FILE_BYTES
    max_stored_responses: int = TENANT_MAX_STORED_RESPONSES
    batch_file_ttl_s: int = BATCH_FILE_TTL_S

    def __post_init__(self) -> None:
        for name in ("max_files", "max_file_bytes", "max_stored_responses", "batch_file_ttl_s"):
            _check(getattr(self, name) >= 0, f"{name} must be >= 0 (0: unlimited)")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on the work one request may ask of a gateway, checked as soon as its body is parsed,
    before anything is rendered, tokenized or compiled (``gateway/request_limits.py``; each refusal is
    a 400 naming the parameter, the limit's variable and its value). Each is ``MET_`` + its name in
    capitals.

    - ``max_stop_strings`` 32 of ``max_stop_string_chars`` 512 characters: OpenAI takes 4, but
      lm-eval and vLLM users send a dozen or so; all run through one automaton, built from at most
      16k characters (~10 ms), and a held-back tail is at most 511 characters.
    - ``max_stop_token_ids`` 256: every one is checked on every sampled token.
    - ``max_tools`` 128 (OpenAI's limit) of ``max_tool_bytes`` 32 KiB of JSON each; their
      ``parameters`` and a ``response_format`` schema (``max_schema_bytes`` 64 KiB of JSON) hold at
      most ``max_schema_enum_values`` 1,000 enum values (OpenAI's limit): a grammar's compile time
      grows with both.
    - ``max_messages`` 2,048 chat messages or Responses input items (OpenAI's limit).
    - ``max_request_work`` 2**20 token slots: ``n x max_tokens x (1 + top_logprobs)`` (a text
      completion's ``logprobs`` counts as ``top_logprobs``; without ``max_tokens``, what the context
      leaves). A whole answer with logprobs takes ~70 bytes of JSON a slot, so this bounds it near
      70 MB; ordinary requests pass (``n`` 8 x 4,096 tokens x 21 is 688k; one choice of up to a
      million tokens without alternatives).
    """

    max_stop_strings: int = 32
    max_stop_string_chars: int = 512
    max_stop_token_ids: int = 256
    max_tools: int = 128
    max_tool_bytes: int = 32 * 1024
    max_schema_bytes: int = 64 * 1024
    max_schema_enum_values: int = 1000
    max_messages: int = 2048
    max_request_work: int = 2**20
    max_body_nodes: int = 50_000
    """Strings, arrays and objects in one JSON body (``gateway/edge/body_precheck.py``): parsing holds the
    interpreter lock, ~1 ms per thousand nodes here, so a body that passes is parsed in ~50 ms at most; a
    prompt of token ids is one node, 128 tools with rich schemas some 25k."""

    def __post_init__(self) -> None:
        low = [name for name in self.__dataclass_fields__ if getattr(self, name) < 1]
        if low:  # not _check: DEFAULT_REQUEST_LIMITS is built before it is defined
            raise ValueError(f"{', '.join(low)} must be >= 1")


DEFAULT_REQUEST_LIMITS = RequestLimits()


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What a gateway needs. ``redis_url=None`` means an embedded Redis; empty ``api_keys`` (key ->
    tenant) means no authentication. ``files_dir`` is the file store every gateway and batch runner
    of the fleet shares (``None``: the Files API answers 503); an upload may hold at most
    ``max_file_bytes`` bytes and ``max_file_lines`` lines.

    ``jobs_redis_url`` (``MET_JOBS_REDIS_URL``) is the Redis of the RQ job queues (batches, background
    responses): a plain or Sentinel Redis. Unset, they live on ``redis_url`` — unless that is a Redis
    Cluster, which RQ cannot use (its keys — ``rq:queues``, ``rq:workers``, one queue's list and
    registries — share no hash tag, so its transactions cross slots): a fleet on a cluster sets it,
    or its gateways refuse batches (503) and background responses (400) and ``met batch-runner`` does not
    start. A cluster URL here is refused."""

    redis_url: str | None
    api_keys: Mapping[str, str] = field(repr=False)
    request_timeout_s: float
    max_queue: int
    heartbeat_ttl_s: int
    namespace: str = DEFAULT_NAMESPACE
    log_level: LogLevel = "INFO"
    files_dir: Path | None = None
    replication: Replication = NO_WAIT
    jobs_redis_url: str | None = None
    max_file_bytes: int = MAX_FILE_BYTES
    max_file_lines: int = MAX_FILE_LINES
    response_ttl_s: int = RESPONSE_TTL_S
    """How long a stored Responses API response can be retrieved and continued (``MET_RESPONSE_TTL_S``)."""
    tool_call_parser: str | None = None
    """The tool-call format of every model (``kimi_k2``, ``hermes``, ``qwen3_coder``); None: each model's
    chat template's."""
    reasoning_parser: str | None = None
    """How every model's reasoning is split from its answers (``qwen3``, ``deepseek_r1``); None: each
    model whose chat template writes think blocks is read as ``qwen3``, others not at all."""
    max_queue_wait_s: float = 30.0
    """Refuse (429) a request that could not start within this many seconds (``MET_MAX_QUEUE_WAIT_S``)."""
    tenant_limits: Mapping[str, TenantLimits] = field(default_factory=dict)
    """Per-tenant limits (from ``MET_API_KEYS``); a tenant not named is unlimited."""
    quotas: StorageQuotas = field(default_factory=StorageQuotas)
    """What each tenant may keep in files and stored responses."""
    http: HttpLimits = field(default_factory=HttpLimits)
    """Timeouts and the cap of the gateway's HTTP connections."""
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    """What one request may ask for (stop strings, tools, schemas, messages, the work of its answer)."""

    def __post_init__(self) -> None:
        _check_redis_url(self.redis_url)
        check_jobs_redis_url(self.jobs_redis_url)
        _check(self.max_queue_wait_s > 0, "max_queue_wait_s must be > 0")
        for tenant in self.tenant_limits:
            check_segment(tenant, "tenant")
        _check(self.response_ttl_s >= 1, "response_ttl_s must be >= 1")
        _check_tool_call_parser(self.tool_call_parser)
        _check_reasoning_parser(self.reasoning_parser)
        _check(self.max_file_bytes >= 1, "max_file_bytes must be >= 1")
        _check(self.max_file_lines >= 1, "max_file_lines must be >= 1")
        for api_key, tenant in self.api_keys.items():
            _check(bool(api_key.strip()) and api_key == api_key.strip(), "API keys must be non-blank, unpadded")
            check_segment(tenant, "tenant")
        _check(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        _check(self.max_queue >= 1, "max_queue must be >= 1")
        _check(self.heartbeat_ttl_s >= 1, "heartbeat_ttl_s must be >= 1")
        Keys(self.namespace)

    @property
    def jobs_url(self) -> str | None:
        """The Redis of the RQ job queues: ``jobs_redis_url``, else ``redis_url`` unless that is a Redis
        Cluster (None then: no job queue)."""
        if self.jobs_redis_url is not None:
            return self.jobs_redis_url
        if self.redis_url is None or parse_redis_url(self.redis_url).cluster:
            return None
        return self.redis_url

    @property
    def auth_required(self) -> bool:
        """Whether requests must present one of ``api_keys``."""
        return bool(self.api_keys)

    @property
    def keys(self) -> Keys:
        """The Redis key space to use (request shards on a Redis Cluster: ``Keys.for_redis``)."""
        return Keys.for_redis(self.redis_url, self.namespace)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What a worker needs. ``model_dir=None`` serves the built-in tiny model; ``checkpoint_dir``
    (``MET_CHECKPOINT_DIR``), when set, adds a directory tier for checkpoints behind memory and Redis;
    they live ``checkpoint_ttl_s`` in Redis. ``decode_checkpoint_interval`` (0: off) checkpoints a
    running request every that many generated tokens, for another worker to resume it.
    ``stream_interval`` (vLLM's option): a request's first token leaves the worker at once, the rest
    every that many steps (all streams' together, in one write) and with its end; more than 1 trades
    smooth streams for less work per token in Redis, gateways and clients (``Worker._send_held``).

    On SIGTERM a worker takes nothing new; with ``drain_handoff`` it checkpoints its requests and
    hands them back to the queue at once (those it cannot hand back, and every one without it, get
    up to ``drain_timeout_s`` to finish). Off by default: a lone worker should finish what it runs,
    while a fleet scaling down (``compose.yaml``, ``met fleet up``) turns it on. A request whose
    queue entry was given to more than ``max_deliveries`` workers that were all lost ends with an
    error and a dead-letter entry."""

    redis_url: str | None
    model_dir: Path | None
    checkpoint_dir: Path | None
    kernels: KernelBackend
    heartbeat_ttl_s: int
    namespace: str = DEFAULT_NAMESPACE
    log_level: LogLevel = "INFO"
    drain_timeout_s: float = 30.0
    checkpoint_ttl_s: int = 3600
    drain_handoff: bool = False
    decode_checkpoint_interval: int = 64
    max_deliveries: int = 3
    replication: Replication = NO_WAIT
    stream_interval: int = 1

    def __post_init__(self) -> None:
        _check_redis_url(self.redis_url)
        _check(self.heartbeat_ttl_s >= 1, "heartbeat_ttl_s must be >= 1")
        _check(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _check(self.checkpoint_ttl_s >= 1, "checkpoint_ttl_s must be >= 1")
        _check(self.decode_checkpoint_interval >= 0, "decode_checkpoint_interval must be >= 0 (0: off)")
        _check(self.max_deliveries >= 1, "max_deliveries must be >= 1")
        _check(self.stream_interval >= 1, "stream_interval must be >= 1")
        Keys(self.namespace)

    @property
    def keys(self) -> Keys:
        """The Redis key space to use (request shards on a Redis Cluster: ``Keys.for_redis``)."""
        return Keys.for_redis(self.redis_url, self.namespace)


@dataclass(frozen=True, slots=True)
class BatchRunnerSettings:
    """What a batch runner needs: the gateway it drives in-process (its ``files_dir`` and Redis),
    how many lines of one batch are in flight at once (``window``), and ``lease_s``: a runner that
    has not renewed its job's lease for that long is taken for dead, and its job is run again."""

    gateway: GatewaySettings
    window: int = 64
    lease_s: int = 10

    def __post_init__(self) -> None:
        _check(self.gateway.files_dir is not None, "the batch runner needs a files_dir")
        redis_url = self.gateway.redis_url
        _check(
            redis_url is None or self.gateway.jobs_url is not None,
            "the batch runner needs a Redis for its RQ job queue: MET_REDIS_URL is a Redis Cluster, which RQ "
            "cannot use; set MET_JOBS_REDIS_URL to a plain or Sentinel Redis (every gateway and batch runner "
            "the same)",
        )
        _check(self.window >= 1, "window must be >= 1")
        _check(self.lease_s >= 2, "lease_s must be >= 2")


class MetraleSettings(BaseSettings):
    """Every ``MET_*`` variable, parsed. ``MET_API_KEYS`` is
    ``key[:tenant[:max_concurrent[:tokens_per_min]]],...`` (see ``parse_api_keys``)."""

    model_config = SettingsConfigDict(env_prefix="MET_", env_ignore_empty=True, extra="ignore")

    redis_url: str | None = None
    jobs_redis_url: str | None = None
    api_keys: Annotated[dict[str, ApiKey], NoDecode] = Field(default_factory=dict, repr=False)
    namespace: str = DEFAULT_NAMESPACE
    checkpoint_dir: Path | None = None
    kernels: KernelBackend = KernelBackend.AUTO
    heartbeat_ttl_s: int = 10
    drain_timeout_s: float = 30.0
    checkpoint_ttl_s: int = 3600
    drain_handoff: bool = False
    decode_checkpoint_interval: int = 64
    stream_interval: int = 1
    max_deliveries: int = 3
    request_timeout_s: float = 600.0
    max_queue: int = 1024
    max_queue_wait_s: float = 30.0
    log_level: LogLevel = "INFO"
    model_dir: Path | None = None
    cache_dir: Path = Path("~/.cache/metrale")
    files_dir: Path | None = None
    max_file_bytes: int = MAX_FILE_BYTES
    max_file_lines: int = MAX_FILE_LINES
    batch_window: int = 64
    batch_lease_s: int = 10
    response_ttl_s: int = RESPONSE_TTL_S
    tenant_max_files: int = TENANT_MAX_FILES
    tenant_max_file_bytes: int = TENANT_MAX_FILE_BYTES
    tenant_max_stored_responses: int = TENANT_MAX_STORED_RESPONSES
    batch_file_ttl_s: int = BATCH_FILE_TTL_S
    max_stop_strings: int = DEFAULT_REQUEST_LIMITS.max_stop_strings
    max_stop_string_chars: int = DEFAULT_REQUEST_LIMITS.max_stop_string_chars
    max_stop_token_ids: int = DEFAULT_REQUEST_LIMITS.max_stop_token_ids
    max_tools: int = DEFAULT_REQUEST_LIMITS.max_tools
    max_tool_bytes: int = DEFAULT_REQUEST_LIMITS.max_tool_bytes
    max_schema_bytes: int = DEFAULT_REQUEST_LIMITS.max_schema_bytes
    max_schema_enum_values: int = DEFAULT_REQUEST_LIMITS.max_schema_enum_values
    max_messages: int = DEFAULT_REQUEST_LIMITS.max_messages
    max_request_work: int = DEFAULT_REQUEST_LIMITS.max_request_work
    max_body_nodes: int = DEFAULT_REQUEST_LIMITS.max_body_nodes
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    redis_wait_replicas: int = 0
    redis_wait_timeout_ms: int = 100
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    http_keep_alive_s: int = 5
    http_max_connections: int = 10_000

    @field_validator("api_keys", mode="before")
    @classmethod
    def _parse_api_keys(cls, value: Any) -> Any:
        return parse_api_keys(value) if isinstance(value, str) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("checkpoint_dir", "model_dir", "cache_dir", "files_dir", mode="after")
    @classmethod
    def _expand_home(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    def gateway(self) -> GatewaySettings:
        """The gateway's view of these settings."""
        return GatewaySettings(
            redis_url=self.redis_url,
            api_keys=types.MappingProxyType({key: entry.tenant for key, entry in self.api_keys.items()}),
            tenant_limits=types.MappingProxyType(tenant_limits(self.api_keys)),
            max_queue_wait_s=self.max_queue_wait_s,
            request_timeout_s=self.request_timeout_s,
            max_queue=self.max_queue,
            heartbeat_ttl_s=self.heartbeat_ttl_s,
            namespace=self.namespace,
            log_level=self.log_level,
            files_dir=self.resolved_files_dir,
            max_file_bytes=self.max_file_bytes,
            max_file_lines=self.max_file_lines,
            response_ttl_s=self.response_ttl_s,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            replication=self.replication,
            jobs_redis_url=self.jobs_redis_url,
            quotas=StorageQuotas(
                max_files=self.tenant_max_files,
                max_file_bytes=self.tenant_max_file_bytes,
                max_stored_responses=self.tenant_max_stored_responses,
                batch_file_ttl_s=self.batch_file_ttl_s,
            ),
            http=HttpLimits(
                header_timeout_s=self.http_header_timeout_s,
                body_timeout_s=self.http_body_timeout_s,
                keep_alive_s=self.http_keep_alive_s,
                max_connections=self.http_max_connections,
            ),
            request_limits=RequestLimits(**{name: getattr(self, name) for name in RequestLimits.__dataclass_fields__}),
        )

    @property
    def replication(self) -> Replication:
        """``MET_REDIS_WAIT_REPLICAS`` and ``MET_REDIS_WAIT_TIMEOUT_MS``: how writes that must survive a
        failover are confirmed (``replication.py``)."""
        return Replication(self.redis_wait_replicas, self.redis_wait_timeout_ms)

    @property
    def resolved_files_dir(self) -> Path:
        """``MET_FILES_DIR``, else ``files/`` under ``MET_CACHE_DIR``."""
        return self.files_dir if self.files_dir is not None else self.cache_dir / "files"

    def batch_runner(self) -> BatchRunnerSettings:
        """The batch runner's view of these settings."""
        return BatchRunnerSettings(gateway=self.gateway(), window=self.batch_window, lease_s=self.batch_lease_s)

    def worker(self) -> WorkerSettings:
        """The worker's view of these settings."""
        return WorkerSettings(
            redis_url=self.redis_url,
            model_dir=self.model_dir,
            checkpoint_dir=self.checkpoint_dir,
            kernels=self.kernels,
            heartbeat_ttl_s=self.heartbeat_ttl_s,
            namespace=self.namespace,
            log_level=self.log_level,
            drain_timeout_s=self.drain_timeout_s,
            checkpoint_ttl_s=self.checkpoint_ttl_s,
            drain_handoff=self.drain_handoff,
            decode_checkpoint_interval=self.decode_checkpoint_interval,
            max_deliveries=self.max_deliveries,
            replication=self.replication,
            stream_interval=self.stream_interval,
        )


def load_settings() -> MetraleSettings:
    """Read the ``MET_*`` environment variables; raises ``pydantic.ValidationError`` on bad values."""
    return MetraleSettings()


def parse_api_keys(text: str) -> dict[str, ApiKey]:
    """Parse ``"k1,k2:acme,k3:beta:4:60000"`` (``key[:tenant[:max_concurrent[:tokens_per_min]]]``)
    into ``{"k1": ApiKey(DEFAULT_TENANT), "k2": ApiKey("acme"), "k3": ApiKey("beta", TenantLimits(4, 60000))}``.

    Blank entries are skipped; an empty tenant is ``DEFAULT_TENANT``, an empty limit unlimited. A
    tenant's limits may be given on any of its keys; keys that give them again must give the same.
    Errors never echo a key."""
    api_keys: dict[str, ApiKey] = {}
    entries = [part.strip() for part in text.split(",")]
    for position, entry in enumerate(filter(None, entries), start=1):
        parts = [part.strip() for part in entry.split(":")]
        api_key = parts[0]
        if not api_key or api_key in api_keys or len(parts) > 4:  # the message must not echo the secret
            raise ValueError(f"API key entry {position} is empty, repeats an earlier key or has more than 4 parts")
        tenant = (parts[1] if len(parts) > 1 else "") or DEFAULT_TENANT
        numbers = [_limit(part, position) for part in parts[2:]] + [None, None]
        api_keys[api_key] = ApiKey(tenant, TenantLimits(numbers[0], numbers[1]))
    tenant_limits(api_keys)  # refuses conflicting limits now
    return api_keys


def tenant_limits(api_keys: Mapping[str, ApiKey]) -> dict[str, TenantLimits]:
    """The limits of every tenant that has some, from its keys; raises ``ValueError`` when two keys
    of one tenant give different limits."""
    limits: dict[str, TenantLimits] = {}
    for entry in api_keys.values():
        if entry.limits.unlimited:
            continue
        known = limits.setdefault(entry.tenant, entry.limits)
        _check(
            known == entry.limits, f"API key entry limits conflict: tenant {entry.tenant!r} is given two different ones"
        )
    return limits


def _limit(text: str, position: int) -> int | None:
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"API key entry {position}: limits must be whole numbers >= 1 (or empty), got {text!r}")
    return int(text)


def _check_redis_url(url: str | None) -> None:
    """A ``ValueError`` saying what is wrong with ``url`` unless it is one of ``redis_url.py``'s forms (a
    Redis Cluster's too: a process that does not serve one refuses it as it connects)."""
    if url is not None:
        try:
            parse_redis_url(url)
        except ValueError as error:
            raise ValueError(f"redis_url: {error}") from None


def check_jobs_redis_url(url: str | None) -> None:
    """A ``ValueError`` unless ``url`` is None or a plain or Sentinel Redis RQ can run on."""
    if url is not None:
        try:
            target = parse_redis_url(url)
        except ValueError as error:
            raise ValueError(f"jobs_redis_url: {error}") from None
        if target.cluster:
            raise ValueError(
                "jobs_redis_url (MET_JOBS_REDIS_URL): RQ cannot run on a Redis Cluster (its keys share no hash "
                "slot); give a plain redis:// or a redis+sentinel:// URL"
            )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_reasoning_parser(name: str | None) -> None:
    from metrale.text.reasoning import check_reasoning_parser  # the parsers live with the text code

    check_reasoning_parser(name)


def _check_tool_call_parser(name: str | None) -> None:
    if name is None:
        return
    from metrale.text.tool_calls.formats import TOOL_CALL_FORMATS  # the formats live with the text code

    known = ", ".join(TOOL_CALL_FORMATS)
    _check(name in TOOL_CALL_FORMATS, f"unknown tool-call parser {name!r}; known: {known}")
