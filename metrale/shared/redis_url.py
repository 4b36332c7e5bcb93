"""What ``MET_REDIS_URL`` may say, parsed into a ``RedisTarget`` (no connection is made here).

Forms:

- ``redis://[user:password@]host[:port][/db]``
- ``rediss://[user:password@]host[:port][/db][?ssl_ca_certs=…&ssl_certfile=…&ssl_keyfile=…&ssl_cert_reqs=…]``
- ``unix://[user:password@]/path/to/redis.sock[?db=N]``
- ``redis+sentinel://[user:password@]host1[:port1],host2[:port2],…/service_name[/db]`` — the primary
  the sentinels name for ``service_name``, followed through failovers (``rediss+sentinel://``: TLS
  to the sentinels and to the primary). ``user:password`` authenticate to the primary; sentinels that
  want their own take ``?sentinel_username=…&sentinel_password=…``.
- ``redis+cluster://[user:password@]host1[:port1],host2[:port2],…[/0]`` — a Redis Cluster, found from any
  of the nodes named (the client learns the others and which owns each slot from them);
  ``rediss+cluster://`` speaks TLS to every node. A cluster has database 0 alone.

User names and passwords are percent-decoded. Any other query parameter, a TLS option without TLS, or
a malformed host, port, service or database is a ``ValueError`` that says which.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from urllib.parse import parse_qsl, unquote

REDIS_PORT = 6379
SENTINEL_PORT = 26379
SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster")
CERT_REQS = ("none", "optional", "required")
TLS_PARAMETERS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
SENTINEL_PARAMETERS = ("sentinel_username", "sentinel_password")
CLUSTER_NOT_SERVED = (
    "redis+cluster:// is not served by this process yet (met gateway, met worker, met batch-runner, met top and "
    "met fleet up serve it): its Redis "
    "transactions span keys of several hash slots, which a Redis Cluster refuses (issue #34); use redis:// or "
    "redis+sentinel://"
)


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """TLS settings (redis-py's ``ssl_*`` connection arguments): the CA file that signs the server's
    certificate, this client's certificate and key (mutual TLS), how strictly the server's
    certificate is checked, and whether its host name must match."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: str = "required"
    check_hostname: bool | None = None

    def connection_kwargs(self) -> dict[str, object]:
        """The arguments redis-py's ``Redis``/``Sentinel`` take for these settings."""
        kwargs: dict[str, object] = {"ssl": True, "ssl_cert_reqs": self.cert_reqs}
        optional = {"ssl_ca_certs": self.ca_certs, "ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile}
        kwargs |= {name: value for name, value in optional.items() if value is not None}
        if self.check_hostname is not None:
            kwargs["ssl_check_hostname"] = self.check_hostname
        return kwargs


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """One Redis deployment: a server (``hosts`` holds one address), a Unix socket (``socket_path``), the
    primary of ``service`` as named by the sentinels in ``hosts``, or a Redis Cluster whose startup
    nodes are ``hosts``."""

    scheme: str
    hosts: tuple[tuple[str, int], ...] = ()
    socket_path: str | None = None
    service: str | None = None
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    tls: TlsOptions | None = None
    sentinel_username: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)

    @property
    def follows_failover(self) -> bool:
        """Whether the primary is found through sentinels (and may move)."""
        return self.service is not None

    @property
    def cluster(self) -> bool:
        """Whether this is a Redis Cluster (keys spread over shards by hash slot)."""
        return self.scheme.endswith("+cluster")

    def display(self) -> str:
        """The URL without its credentials, for logs and errors."""
        where = self.socket_path or ",".join(f"{host}:{port}" for host, port in self.hosts)
        service = f"/{self.service}" if self.service is not None else ""
        return f"{self.scheme}://{where}{service}/{self.db}"


def parse_redis_url(url: str) -> RedisTarget:
    """``url`` as a ``RedisTarget``; a ``ValueError`` naming what is wrong when it is not one of the forms
    in this module's docstring."""
    scheme, separator, rest = url.partition("://")
    if not separator or scheme not in SCHEMES:
        raise ValueError(f"a Redis URL starts with one of {', '.join(s + '://' for s in SCHEMES)}; got {url[:40]!r}")
    rest, _, query = rest.partition("?")
    parameters = _parameters(query)
    credentials, at, location = rest.rpartition("@")
    username, password = _credentials(credentials) if at else (None, None)
    tls = _tls(scheme, parameters)
    sentinel_auth = {name: parameters.pop(name) for name in SENTINEL_PARAMETERS if name in parameters}
    if sentinel_auth and not scheme.endswith("+sentinel"):
        raise ValueError(f"{', '.join(sentinel_auth)} only apply to redis+sentinel:// URLs")
    base = RedisTarget(scheme=scheme, username=username, password=password, tls=tls)
    if scheme == "unix":
        target = _unix(location, parameters, base)
    elif scheme.endswith("+sentinel"):
        target = _sentinel(location, base, sentinel_auth)
    elif scheme.endswith("+cluster"):
        target = _cluster(location, base)
    else:
        target = _server(location, base)
    if parameters:
        raise ValueError(f"unknown Redis URL parameter(s): {', '.join(sorted(parameters))}")
    return target


def _parameters(query: str) -> dict[str, str]:
    parameters: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if name in parameters:
            raise ValueError(f"Redis URL parameter {name!r} is given twice")
        parameters[name] = value
    return parameters


def _credentials(text: str) -> tuple[str | None, str | None]:
    user, colon, password = text.partition(":")
    if not colon:  # redis-py reads a lone ``secret@`` as a password, as redis-cli does
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _tls(scheme: str, parameters: dict[str, str]) -> TlsOptions | None:
    given = {name: parameters.pop(name) for name in TLS_PARAMETERS if name in parameters}
    if not scheme.startswith("rediss"):
        if given:
            raise ValueError(f"{', '.join(given)} need TLS: use rediss:// (or rediss+sentinel://, rediss+cluster://)")
        return None
    cert_reqs = given.get("ssl_cert_reqs", "required")
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}; got {cert_reqs!r}")
    check_hostname = given.get("ssl_check_hostname")
    return TlsOptions(
        ca_certs=given.get("ssl_ca_certs") or None,
        certfile=given.get("ssl_certfile") or None,
        keyfile=given.get("ssl_keyfile") or None,
        cert_reqs=cert_reqs,
        check_hostname=None if check_hostname is None else _boolean("ssl_check_hostname", check_hostname),
    )


def _unix(location: str, parameters: dict[str, str], base: RedisTarget) -> RedisTarget:
    if not location.startswith("/") or location == "/":
        raise ValueError("a unix:// URL names an absolute socket path: unix:///path/to/redis.sock")
    db = _database(parameters.pop("db", "0"))
    return replace(base, socket_path=unquote(location), db=db)


def _server(location: str, base: RedisTarget) -> RedisTarget:
    address, _, path = location.partition("/")
    if "," in address:
        raise ValueError(
            "several hosts need redis+sentinel://host1,host2,…/service_name or redis+cluster://host1,host2,…"
        )
    db = _database(path) if path else 0
    return replace(base, hosts=(_address(address, REDIS_PORT),), db=db)


def _sentinel(location: str, base: RedisTarget, auth: dict[str, str]) -> RedisTarget:
    addresses, _, path = location.partition("/")
    service, _, db_text = path.partition("/")
    if not service:
        raise ValueError("a redis+sentinel:// URL names its service: redis+sentinel://host1,host2/service_name[/db]")
    if "/" in db_text:
        raise ValueError(f"unexpected path after the database in a sentinel URL: {path!r}")
    hosts = tuple(_address(address, SENTINEL_PORT) for address in addresses.split(","))
    return replace(
        base,
        hosts=hosts,
        service=unquote(service),
        db=_database(db_text) if db_text else 0,
        sentinel_username=auth.get("sentinel_username") or None,
        sentinel_password=auth.get("sentinel_password") or None,
    )


def _cluster(location: str, base: RedisTarget) -> RedisTarget:
    addresses, _, path = location.partition("/")
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 alone: redis+cluster://host1,host2[/0]; got path {path!r}")
    return replace(base, hosts=tuple(_address(address, REDIS_PORT) for address in addresses.split(",")))


def _address(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, bracket, port_text = text[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise ValueError(f"malformed IPv6 address in a Redis URL: {text!r}")
        port_text = port_text[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"a Redis URL host is empty (in {text!r})")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"Redis URL port must be a number in 1..65535; got {port_text!r}")
    return host, int(port_text)


def _database(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"a Redis database is a number >= 0; got {text!r}")
    return int(text)


def _boolean(name: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} is true or false; got {text!r}")
