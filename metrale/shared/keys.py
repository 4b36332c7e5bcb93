"""Every Redis key and channel name Metrale uses, built in one place.

| method | key | kind |
| --- | --- | --- |
| ``request_stream(prio)`` | ``met:req:{prio}`` | stream, consumer group ``WORKER_GROUP`` |
| ``token_channel(id)`` | ``met:out:{id}`` | pub/sub channel of ``TokenEvent`` |
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
| ``batch(tenant, id)`` | ``met:batch:{tenant}:{id}`` | hash: a batch object (status, counts, file ids) |
| ``batch_results(tenant, id)`` | ``met:batch:{tenant}:{id}:results`` | hash: custom_id -> line, while it runs |
| ``batch_index(tenant)`` | ``met:batches:{tenant}`` | sorted set: a tenant's batch ids by creation time |
| ``active_batches()`` | ``met:active-batches`` | sorted set: ``{tenant}:{id}`` of unfinished batches, by creation |
| ``batch_queue()`` | ``{namespace}.batches`` | the RQ queue name of batch jobs (RQ keeps its own ``rq:`` keys) |
| ``dead_letter()`` | ``met:dead`` | stream of payloads that failed to decode, and poison requests |
| ``checkpoint_counters()`` | ``met:metrics:checkpoints`` | hash: fleet-wide checkpoint counters |
| ``failover_counters()`` | ``met:metrics:failover`` | hash: fleet-wide resume, hand-back, reclaim counters |
| ``gateway_counters()`` | ``met:metrics:gateway`` | hash: fleet-wide gateway counters (429s) |
| ``tenant_in_flight(tenant)`` | ``met:tenant:{tenant}:inflight`` | sorted set: request ids by lease expiry |
| ``tenant_tokens(tenant, minute)`` | ``met:tenant:{tenant}:tokens:{minute}`` | string, TTL: tokens charged |

The ``met`` prefix is the namespace of a ``Keys`` instance; tests pick their own.

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

WORKER_GROUP = "workers"
"""The consumer group every worker reads the request streams with."""

DEFAULT_NAMESPACE = "met"

QUEUE_FULL_FIELD = "queue_full_rejections"
"""The field of ``gateway_counters()`` counting the requests gateways refused with a 429 (queue full:
too many untaken, or the estimated wait over ``MET_MAX_QUEUE_WAIT_S``)."""

TENANT_LIMITED_FIELD = "tenant_limit_rejections"
"""The field of ``gateway_counters()`` counting the requests refused with a 429 for a tenant's limits."""

LOST_WORKER_MEMORY_S = 600
"""How long a worker that stopped beating without withdrawing stays in ``worker_index`` (shown lost)."""

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

    def __post_init__(self) -> None:
        check_segment(self.namespace, "namespace")

    def request_stream(self, priority: Priority) -> str:
        """The stream of queued ``GenerateRequest`` s of one priority."""
        return self._key("req", Priority(priority).value)

    def token_channel(self, request_id: str) -> str:
        """The pub/sub channel carrying one request's ``TokenEvent`` s."""
        return self._key("out", check_segment(request_id, "request id"))

    def run_record(self, request_id: str) -> str:
        """The hash with one request's status, finish reason, error and worker."""
        return self._key("run", check_segment(request_id, "request id"))

    def run_events(self, request_id: str) -> str:
        """The list of one request's emitted ``TokenEvent`` s (encoded), in the order written."""
        return f"{self.run_record(request_id)}:events"

    def cancel_channel(self) -> str:
        """The pub/sub channel every worker listens on for ``CancelRequest`` s."""
        return self._key("cancel")

    def worker(self, worker_id: str) -> str:
        """The heartbeat hash of one worker; expires when the worker stops beating."""
        return self._key("worker", check_segment(worker_id, "worker id"))

    def worker_index(self) -> str:
        """The sorted set of worker ids scored by their last heartbeat (unix seconds): written with
        every heartbeat, removed when a worker stops cleanly, so a member whose heartbeat key is gone
        is a lost worker; members older than ``LOST_WORKER_MEMORY_S`` are trimmed by the heartbeats."""
        return self._key("workers")

    def control_channel(self, worker_id: str) -> str:
        """The pub/sub channel one worker listens on for ``WorkerControl`` orders (drain)."""
        return self._key("control", check_segment(worker_id, "worker id"))

    def running_index(self) -> str:
        """The sorted set of the ids of requests some worker has taken and not finished or handed
        back, scored by when it took them (unix seconds); written in the same ``MULTI`` as the status."""
        return self._key("running")

    def running_info(self) -> str:
        """The hash of the requests in ``running_index``: id -> ``record.RunningEntry`` (JSON)."""
        return self._key("running", "info")

    def model(self, name: str) -> str:
        """The hash holding a served model's ``ModelAnnouncement``."""
        return self._key("model", check_segment(name, "model name"))

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
        return self._key("session", check_segment(tenant, "tenant"), check_segment(session_id, "session id"))

    def checkpoint_counters(self) -> str:
        """The hash of fleet-wide checkpoint counters (lookups, hits, misses by reason, bytes)."""
        return self._key("metrics", "checkpoints")

    def failover_counters(self) -> str:
        """The hash of fleet-wide failover counters (resumed requests, tokens prefilled again, ...)."""
        return self._key("metrics", "failover")

    def gateway_counters(self) -> str:
        """The hash of fleet-wide gateway counters (``queue_full_rejections``: 429s)."""
        return self._key("metrics", "gateway")

    def tenant_in_flight(self, tenant: str) -> str:
        """The sorted set of a tenant's requests in flight (request id, scored by lease expiry, unix s)."""
        return self._key("tenant", check_segment(tenant, "tenant"), "inflight")

    def tenant_tokens(self, tenant: str, minute: int) -> str:
        """The counter of tokens charged to a tenant in one minute (``minute``: unix seconds // 60)."""
        return self._key("tenant", check_segment(tenant, "tenant"), "tokens", str(minute))

    def session_transcript(self, tenant: str, session_id: str) -> str:
        """The hash with a session's transcript: rendered text and the exact token ids consumed."""
        return f"{self.session(tenant, session_id)}:transcript"

    def file(self, tenant: str, file_id: str) -> str:
        """The hash with one file's metadata (its bytes live in the file store directory)."""
        return self._key("file", check_segment(tenant, "tenant"), check_segment(file_id, "file id"))

    def file_index(self, tenant: str) -> str:
        """The sorted set of a tenant's file ids, scored by creation time."""
        return self._key("files", check_segment(tenant, "tenant"))

    def file_sizes(self, tenant: str) -> str:
        """The hash of a tenant's file ids and their sizes in bytes (what its file quota counts)."""
        return f"{self.file_index(tenant)}:bytes"

    def file_expiry(self) -> str:
        """The sorted set of every file that expires, as ``{tenant}:{file id}``, scored by its expiry."""
        return self._key("files-expiring")

    def response_index(self, tenant: str) -> str:
        """The sorted set of a tenant's stored response ids, scored by when they expire."""
        return self._key("resps", check_segment(tenant, "tenant"))

    def response(self, tenant: str, response_id: str) -> str:
        """The hash holding one Responses API response: its object, input items and exact transcript."""
        return self._key("resp", check_segment(tenant, "tenant"), check_segment(response_id, "response id"))

    def batch(self, tenant: str, batch_id: str) -> str:
        """The hash holding one batch object."""
        return self._key("batch", check_segment(tenant, "tenant"), check_segment(batch_id, "batch id"))

    def batch_results(self, tenant: str, batch_id: str) -> str:
        """The hash of a batch's finished lines: ``custom_id`` -> the output line (JSON); deleted when
        the batch ends (its files hold the lines then)."""
        return f"{self.batch(tenant, batch_id)}:results"

    def batch_index(self, tenant: str) -> str:
        """The sorted set of a tenant's batch ids, scored by creation time."""
        return self._key("batches", check_segment(tenant, "tenant"))

    def active_batches(self) -> str:
        """The sorted set of every unfinished batch as ``{tenant}:{batch id}`` (a tenant holds no
        ``:``), scored by creation time; a batch leaves it when its status becomes terminal."""
        return self._key("active-batches")

    def batch_queue(self) -> str:
        """The name of the RQ queue batch jobs wait in (RQ builds its own ``rq:`` keys from it)."""
        return f"{self.namespace}.batches"

    def replication_mark(self) -> str:
        """A counter a writer bumps right before each ``WAIT`` (``replication.py``): ``WAIT`` covers the
        writes of its own connection, and the bump makes that connection's newest write come after the
        write to confirm, whichever pooled connection made it."""
        return self._key("replication", "mark")

    def dead_letter(self) -> str:
        """The stream where payloads that failed to decode, and requests that kept losing their
        worker, are set aside."""
        return self._key("dead")

    def worker_pattern(self) -> str:
        """A ``SCAN MATCH`` pattern for every worker heartbeat key."""
        return self._key("worker", "*")

    def token_channel_pattern(self) -> str:
        """A ``PSUBSCRIBE`` pattern for every request's token channel (monitoring, tests)."""
        return self._key("out", "*")

    def model_pattern(self) -> str:
        """A ``SCAN MATCH`` pattern for every model announcement key."""
        return self._key("model", "*")

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))


DEFAULT_KEYS = Keys()
"""The production key space, ``met:*``."""
