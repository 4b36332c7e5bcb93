"""Every Redis key and channel name Metrale uses, built in one place.

| method | key | kind |
| --- | --- | --- |
| ``request_stream(prio)`` | ``met:req:{prio}`` | stream, consumer group ``WORKER_GROUP`` |
| ``token_channel(id)`` | ``met:out:{id}`` | pub/sub channel of ``TokenEvent`` (requests without ``reply_to``) |
| ``reply_channel(rid)`` | ``met:relay:{rid}`` | pub/sub channel of one relay's ``TokenEventGroup`` s, one a step |
| ``run_record(id)`` | ``met:run:{id}`` | hash, TTL: a request's status, finish reason, worker |
| ``run_events(id)`` | ``met:run:{id}:events`` | list, TTL: the request's encoded ``TokenEvent`` s |
| ``cancel_channel()`` | ``met:cancel`` | pub/sub channel of ``CancelRequest`` |
| ``worker(wid)`` | ``met:worker:{wid}`` | hash, TTL: a worker's heartbeat |
| ``worker_index()`` | ``met:workers`` | sorted set: worker ids by their last heartbeat (unix s) |
| ``control_channel(wid)`` | ``met:control:{wid}`` | pub/sub channel of ``WorkerControl`` to one worker |
| ``running_index()`` | ``met:running`` | sorted set: ids of requests a worker runs, by when taken |
| ``running_info()`` | ``met:running:info`` | hash: request id -> what ``met top`` shows of it (``RunningEntry``) |
| ``model(name)`` | ``met:model:{name}`` | hash: a ``ModelAnnouncement`` |
| ``checkpoint(fp, tenant, hash)`` | ``met:ckpt:{fp}:{tenant}:{hash}`` | string, TTL: state bytes |
| ``session(tenant, sid)`` | ``met:session:{tenant}:{sid}`` | hash, TTL: a session's newest checkpoint |
| ``file(tenant, id)`` | ``met:file:{tenant}:{id}`` | hash: an uploaded or produced file's metadata |
| ``file_index(tenant)`` | ``met:files:{tenant}`` | sorted set: a tenant's file ids by creation time |
| ``file_sizes(tenant)`` | ``met:files:{tenant}:bytes`` | hash: file id -> its size (what the file quota counts) |
| ``file_expiry()`` | ``met:files-expiring`` | sorted set: ``{tenant}:{file id}`` of files that expire, by expiry |
| ``response(tenant, id)`` | ``met:resp:{tenant}:{id}`` | hash, TTL: a stored response and its exact transcript |
| ``response_index(tenant)`` | ``met:resps:{tenant}`` | sorted set: a tenant's stored response ids by expiry |
| ``response_events(tenant, id)`` | ``met:resp:{tenant}:{id}:events`` | stream, TTL: background events, id ``{seq}-1`` |
| ``batch(tenant, id)`` | ``met:batch:{tenant}:{id}`` | hash: a batch object (status, counts, file ids) |
| ``batch_results(tenant, id)`` | ``met:batch:{tenant}:{id}:results`` | hash: custom_id -> line, while it runs |
| ``batch_index(tenant)`` | ``met:batches:{tenant}`` | sorted set: a tenant's batch ids by creation time |
| ``active_batches()`` | ``met:active-batches`` | sorted set: ``{tenant}:{id}`` of unfinished batches, by creation |
| ``batch_queue()`` | ``{namespace}.batches`` | the RQ queue name of batch jobs (RQ keeps its own ``rq:`` keys) |
| ``response_queue()`` | ``{namespace}.responses`` | the RQ queue name of background responses' jobs |
| ``dead_letter(shard)`` | ``met:dead`` | stream of payloads that failed to decode, and poison requests |
| ``checkpoint_counters()`` | ``met:metrics:checkpoints`` | hash: fleet-wide checkpoint counters |
| ``failover_counters()`` | ``met:metrics:failover`` | hash: fleet-wide resume, hand-back, reclaim counters |
| ``gateway_counters()`` | ``met:metrics:gateway`` | hash: fleet-wide gateway counters (429s) |
| ``speculation_counters()`` | ``met:metrics:speculation`` | hash: fleet-wide speculative decoding counters |
| ``tenant_in_flight(tenant)`` | ``met:tenant:{tenant}:inflight`` | sorted set: request ids by lease expiry |
| ``tenant_tokens(tenant, minute)`` | ``met:tenant:{tenant}:tokens:{minute}`` | string, TTL: tokens charged |

The ``met`` prefix is the namespace of a ``Keys`` instance; tests pick their own.

Request shards (``Keys.shards``, for a Redis Cluster; issue #34): with ``shards`` > 1 the keys of one
request and the queue it waits in carry the hash tag of the request's shard (``slots.py``) as their third
part — ``met:req:{s3.7}:interactive``, ``met:run:{s3.7}:<id>``, ``met:run:{s3.7}:<id>:events``,
``met:out:{s3.7}:<id>``, ``met:running:{s3.7}`` and ``met:running:{s3.7}:info`` — so a transaction over
one request's keys, its stream entry and the running index stays in one slot, and the shards spread
over the cluster's primaries. With ``shards`` = 1 (one Redis, Sentinel) the names are the table's.
Every process of a fleet must use the same count: ``Keys.for_redis(url, namespace)`` gives
``CLUSTER_SHARDS`` for a cluster URL and 1 otherwise (``request_shards``).

Control and tenant keys (issue #34): in a key space of several shards the fleet-wide keys carry the
tag ``{ctl}`` (``CONTROL_TAG``) after their kind — ``met:worker:{ctl}:<wid>``, ``met:workers:{ctl}``,
``met:model:{ctl}:<name>``, ``met:control:{ctl}:<wid>``, ``met:metrics:{ctl}:failover``,
``met:active-batches:{ctl}``, ``met:files-expiring:{ctl}`` — so a heartbeat's ``MULTI`` (its hash, the
index, its model's announcement) is one slot; a tenant's keys take the tenant as their tag —
``met:session:{acme}:<sid>``, ``met:resp:{acme}:<id>:events``, ``met:batches:{acme}``,
``met:files:{acme}:bytes``, ``met:tenant:{acme}:inflight`` — so an object, its parts and its tenant's
index change in one transaction (the fleet-wide sets beside them are written in one of their own).
Dead letters go to the shard of what they came from (``met:dead:{s3.7}``). Checkpoints stay untagged:
their hash spreads them. With ``shards`` = 1 no key carries a tag.

Every id placed into a key (request, worker, tenant, session, model, fingerprint, hash) must be
1 to 256 characters from ``A-Z a-z 0-9 . _ - / @ + =``; anything else is rejected with a
``ValueError`` rather than escaped. The reasons: ``:`` separates key parts, so a tenant ``a:b`` with
session ``c`` and tenant ``a`` with session ``b:c`` would share one key (one tenant reading
another's checkpoint), and ``met:run:{id}:events`` could collide with another request's record;
glob characters (``* ? [ ] \\``) would turn the scan patterns into different patterns; whitespace
and control characters make keys unreadable in ``redis-cli``. Model names such as
``moonshotai/Kimi-Linear-48B-A3B-Instruct`` pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from metrale.shared.messages import Priority
from metrale.shared.redis_url import RedisTarget, parse_redis_url
from metrale.shared.slots import shard_of, spread_tags

WORKER_GROUP = "workers"
"""The consumer group every worker reads the request streams with."""

DEFAULT_NAMESPACE = "met"

QUEUE_FULL_FIELD = "queue_full_rejections"
"""The field of ``gateway_counters()`` counting the requests gateways refused with a 429 (queue full:
too many untaken, or the estimated wait over ``MET_MAX_QUEUE_WAIT_S``)."""

TENANT_LIMITED_FIELD = "tenant_limit_rejections"
"""The field of ``gateway_counters()`` counting the requests refused with a 429 for a tenant's limits."""

CONTROL_TAG = "ctl"
"""The hash tag of the fleet-wide control keys on a Redis Cluster (module docstring)."""

LOST_WORKER_MEMORY_S = 600
"""How long a worker that stopped beating without withdrawing stays in ``worker_index`` (shown lost)."""

CLUSTER_SHARDS = 12
"""Request shards of a fleet on a Redis Cluster, the same in every process (keys name them): 12 fall
evenly on 2, 3, 4, 6 or 12 primaries (``slots.spread_tags``), and a worker's take costs one pipelined
round trip per node whatever the count."""


def request_shards(url: str | RedisTarget | None) -> int:
    """How many request shards a fleet on ``url`` uses: ``CLUSTER_SHARDS`` on a Redis Cluster, else 1."""
    if url is None:
        return 1
    target = parse_redis_url(url) if isinstance(url, str) else url
    return CLUSTER_SHARDS if target.cluster else 1


_SEGMENT = re.compile(r"[A-Za-z0-9._\-/@+=]{1,256}")


def check_segment(value: str, what: str) -> str:
    """Return ``value`` if it may be placed inside a key, else raise ``ValueError`` naming ``what``."""
    if not isinstance(value, str) or _SEGMENT.fullmatch(value) is None:
        raise ValueError(
            f"invalid {what} {value!r}: use 1-256 characters from A-Z a-z 0-9 . _ - / @ + = "
            "(':' separates Redis key parts)"
        )
    return value


@dataclass(frozen=True, slots=True)
class Keys:
    """Builds Redis key and channel names under ``namespace`` (``met`` in production)."""

    namespace: str = DEFAULT_NAMESPACE
    shards: int = 1
    """Request shards: 1 on one Redis (no hash tags), more on a Redis Cluster (module docstring)."""

    def __post_init__(self) -> None:
        check_segment(self.namespace, "namespace")
        spread_tags(self.shards)  # refuses a count out of range

    @classmethod
    def for_redis(cls, url: str | RedisTarget | None, namespace: str = DEFAULT_NAMESPACE) -> Keys:
        """The key space of a fleet on ``url``: sharded on a Redis Cluster, plain otherwise."""
        return cls(namespace, shards=request_shards(url))

    def shard_of(self, request_id: str) -> int:
        """The shard ``request_id`` belongs to (0 when there is one)."""
        return shard_of(check_segment(request_id, "request id"), self.shards) if self.shards > 1 else 0

    def request_stream(self, priority: Priority, shard: int = 0) -> str:
        """The stream of queued ``GenerateRequest`` s of one priority, in one shard."""
        return self._key("req", *self._shard_part(shard), Priority(priority).value)

    def request_streams(self, priority: Priority) -> tuple[str, ...]:
        """Every shard's stream of one priority, shard 0 first."""
        return tuple(self.request_stream(priority, shard) for shard in range(self.shards))

    def token_channel(self, request_id: str) -> str:
        """The pub/sub channel carrying one request's ``TokenEvent`` s."""
        return self._key("out", *self._request_parts(request_id))

    def reply_channel(self, relay_id: str) -> str:
        """The pub/sub channel of one token relay (a gateway process's): a worker publishes there, once
        per step, the ``TokenEventGroup`` of every request naming that relay in ``reply_to``."""
        return self._key("relay", check_segment(relay_id, "relay id"))

    def run_record(self, request_id: str) -> str:
        """The hash with one request's status, finish reason, error and worker."""
        return self._key("run", *self._request_parts(request_id))

    def run_events(self, request_id: str) -> str:
        """The list of one request's emitted ``TokenEvent`` s (encoded), in the order written."""
        return f"{self.run_record(request_id)}:events"

    def cancel_channel(self) -> str:
        """The pub/sub channel every worker listens on for ``CancelRequest`` s."""
        return self._key("cancel")

    def worker(self, worker_id: str) -> str:
        """The heartbeat hash of one worker; expires when the worker stops beating."""
        return self._control("worker", check_segment(worker_id, "worker id"))

    def worker_index(self) -> str:
        """The sorted set of worker ids scored by their last heartbeat (unix seconds): written with
        every heartbeat, removed when a worker stops cleanly, so a member whose heartbeat key is gone
        is a lost worker; members older than ``LOST_WORKER_MEMORY_S`` are trimmed by the heartbeats."""
        return self._control("workers")

    def control_channel(self, worker_id: str) -> str:
        """The pub/sub channel one worker listens on for ``WorkerControl`` orders (drain)."""
        return self._control("control", check_segment(worker_id, "worker id"))

    def running_index(self, shard: int = 0) -> str:
        """The sorted set of the ids of requests of one shard some worker has taken and not finished or
        handed back, scored by when it took them (unix seconds); written in the same ``MULTI`` as the
        status."""
        return self._key("running", *self._shard_part(shard))

    def running_info(self, shard: int = 0) -> str:
        """The hash of the requests in ``running_index(shard)``: id -> ``record.RunningEntry`` (JSON)."""
        return self._key("running", *self._shard_part(shard), "info")

    def model(self, name: str) -> str:
        """The hash holding a served model's ``ModelAnnouncement``."""
        return self._control("model", check_segment(name, "model name"))

    def checkpoint(self, model_fingerprint: str, tenant: str, token_hash: str) -> str:
        """One recurrent-state checkpoint: the state after consuming exactly the hashed tokens."""
        return self._key(
            "ckpt",
            check_segment(model_fingerprint, "model fingerprint"),
            check_segment(tenant, "tenant"),
            check_segment(token_hash, "token hash"),
        )

    def session(self, tenant: str, session_id: str) -> str:
        """The hash naming a session's newest checkpoint and its token count."""
        return self._tenant_key("session", tenant, check_segment(session_id, "session id"))

    def checkpoint_counters(self) -> str:
        """The hash of fleet-wide checkpoint counters (lookups, hits, misses by reason, bytes)."""
        return self._control("metrics", "checkpoints")

    def failover_counters(self) -> str:
        """The hash of fleet-wide failover counters (resumed requests, tokens prefilled again, ...)."""
        return self._control("metrics", "failover")

    def gateway_counters(self) -> str:
        """The hash of fleet-wide gateway counters (``queue_full_rejections``: 429s)."""
        return self._control("metrics", "gateway")

    def speculation_counters(self) -> str:
        """The hash of fleet-wide speculative decoding counters (drafts, draft and accepted tokens,
        accepted per draft position: ``worker/fleet/speculation_counters.py``)."""
        return self._control("metrics", "speculation")

    def tenant_in_flight(self, tenant: str) -> str:
        """The sorted set of a tenant's requests in flight (request id, scored by lease expiry, unix s)."""
        return self._tenant_key("tenant", tenant, "inflight")

    def tenant_tokens(self, tenant: str, minute: int) -> str:
        """The counter of tokens charged to a tenant in one minute (``minute``: unix seconds // 60)."""
        return self._tenant_key("tenant", tenant, "tokens", str(minute))

    def session_transcript(self, tenant: str, session_id: str) -> str:
        """The hash with a session's transcript: rendered text and the exact token ids consumed."""
        return f"{self.session(tenant, session_id)}:transcript"

    def file(self, tenant: str, file_id: str) -> str:
        """The hash with one file's metadata (its bytes live in the file store directory)."""
        return self._tenant_key("file", tenant, check_segment(file_id, "file id"))

    def file_index(self, tenant: str) -> str:
        """The sorted set of a tenant's file ids, scored by creation time."""
        return self._tenant_key("files", tenant)

    def file_sizes(self, tenant: str) -> str:
        """The hash of a tenant's file ids and their sizes in bytes (what its file quota counts)."""
        return f"{self.file_index(tenant)}:bytes"

    def file_expiry(self) -> str:
        """The sorted set of every file that expires, as ``{tenant}:{file id}``, scored by its expiry."""
        return self._control("files-expiring")

    def response_index(self, tenant: str) -> str:
        """The sorted set of a tenant's stored response ids, scored by when they expire."""
        return self._tenant_key("resps", tenant)

    def response(self, tenant: str, response_id: str) -> str:
        """The hash holding one Responses API response: its object, input items and exact transcript."""
        return self._tenant_key("resp", tenant, check_segment(response_id, "response id"))

    def response_events(self, tenant: str, response_id: str) -> str:
        """The stream of a background response's events (``sequence_number`` n is entry ``n-1``)."""
        return f"{self.response(tenant, response_id)}:events"

    def batch(self, tenant: str, batch_id: str) -> str:
        """The hash holding one batch object."""
        return self._tenant_key("batch", tenant, check_segment(batch_id, "batch id"))

    def batch_results(self, tenant: str, batch_id: str) -> str:
        """The hash of a batch's finished lines: ``custom_id`` -> the output line (JSON); deleted when
        the batch ends (its files hold the lines then)."""
        return f"{self.batch(tenant, batch_id)}:results"

    def batch_index(self, tenant: str) -> str:
        """The sorted set of a tenant's batch ids, scored by creation time."""
        return self._tenant_key("batches", tenant)

    def active_batches(self) -> str:
        """The sorted set of every unfinished batch as ``{tenant}:{batch id}`` (a tenant holds no
        ``:``), scored by creation time; a batch leaves it when its status becomes terminal."""
        return self._control("active-batches")

    def batch_queue(self) -> str:
        """The name of the RQ queue batch jobs wait in (RQ builds its own ``rq:`` keys from it)."""
        return f"{self.namespace}.batches"

    def response_queue(self) -> str:
        """The name of the RQ queue background responses' jobs wait in (batch runners take it first)."""
        return f"{self.namespace}.responses"

    def replication_mark(self) -> str:
        """A counter a writer bumps right before each ``WAIT`` (``replication.py``): ``WAIT`` covers the
        writes of its own connection, and the bump makes that connection's newest write come after the
        write to confirm, whichever pooled connection made it."""
        return self._key("replication", "mark")

    def dead_letter(self, shard: int = 0) -> str:
        """The stream of one request shard where payloads that failed to decode, and requests that kept
        losing their worker, are set aside (in the shard of the stream or request they came from, so
        the ``XACK`` that drops an entry and the ``XADD`` that keeps it are one transaction)."""
        return self._key("dead", *self._shard_part(shard))

    def dead_letters(self) -> tuple[str, ...]:
        """Every shard's dead-letter stream, shard 0 first."""
        return tuple(self.dead_letter(shard) for shard in range(self.shards))

    def worker_pattern(self) -> str:
        """A ``SCAN MATCH`` pattern for every worker heartbeat key."""
        return self._control("worker", "*")

    def token_channel_pattern(self) -> str:
        """A ``PSUBSCRIBE`` pattern for every request's token channel (monitoring, tests)."""
        return self._key("out", "*")

    def reply_channel_pattern(self) -> str:
        """A ``PSUBSCRIBE`` pattern for every relay's reply channel (monitoring, tests)."""
        return self._key("relay", "*")

    def model_pattern(self) -> str:
        """A ``SCAN MATCH`` pattern for every model announcement key."""
        return self._control("model", "*")

    def _shard_part(self, shard: int) -> tuple[str, ...]:
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} is not one of this key space's {self.shards}")
        return () if self.shards == 1 else (f"{{{spread_tags(self.shards)[shard]}}}",)

    @property
    def tagged(self) -> bool:
        """Whether keys carry hash tags: a key space of several request shards, for a Redis Cluster."""
        return self.shards > 1

    def _control(self, kind: str, *rest: str) -> str:
        """A fleet-wide key under ``CONTROL_TAG`` when ``tagged`` (``met:workers:{ctl}``)."""
        return self._key(kind, *((f"{{{CONTROL_TAG}}}",) if self.tagged else ()), *rest)

    def _tenant_key(self, kind: str, tenant: str, *rest: str) -> str:
        """A key of one tenant's, its tenant part the hash tag when ``tagged`` (``met:files:{acme}``)."""
        check_segment(tenant, "tenant")
        return self._key(kind, f"{{{tenant}}}" if self.tagged else tenant, *rest)

    def _request_parts(self, request_id: str) -> tuple[str, ...]:
        return (*self._shard_part(self.shard_of(request_id)), check_segment(request_id, "request id"))

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))


DEFAULT_KEYS = Keys()
"""The production key space, ``met:*``."""
