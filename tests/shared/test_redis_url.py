"""``MET_REDIS_URL`` forms: each parses to what it says, and a malformed one is refused with a reason."""

from __future__ import annotations

import pytest

from metrale.shared.redis_url import RedisTarget, TlsOptions, parse_redis_url


def test_plain_url_with_defaults() -> None:
    assert parse_redis_url("redis://localhost") == RedisTarget(scheme="redis", hosts=(("localhost", 6379),))


def test_plain_url_with_everything() -> None:
    target = parse_redis_url("redis://met%40fleet:p%3Ass@10.0.0.5:6380/3")
    assert target.hosts == (("10.0.0.5", 6380),)
    assert (target.username, target.password, target.db) == ("met@fleet", "p:ss", 3)
    assert target.tls is None and not target.follows_failover


def test_a_lone_secret_before_the_at_is_a_password() -> None:
    target = parse_redis_url("redis://s3cret@host")
    assert (target.username, target.password) == (None, "s3cret")


def test_tls_url_with_a_ca_a_client_certificate_and_an_acl_user() -> None:
    url = "rediss://met:pw@redis.internal:6390/0?ssl_ca_certs=/etc/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
    target = parse_redis_url(url + "&ssl_cert_reqs=optional&ssl_check_hostname=false")
    assert target.tls == TlsOptions("/etc/ca.pem", "/c.pem", "/k.pem", "optional", False)
    assert (target.username, target.password) == ("met", "pw")
    assert target.tls.connection_kwargs() == {
        "ssl": True,
        "ssl_cert_reqs": "optional",
        "ssl_ca_certs": "/etc/ca.pem",
        "ssl_certfile": "/c.pem",
        "ssl_keyfile": "/k.pem",
        "ssl_check_hostname": False,
    }


def test_tls_checks_the_certificate_by_default() -> None:
    assert parse_redis_url("rediss://host").tls == TlsOptions(cert_reqs="required")


def test_unix_socket() -> None:
    target = parse_redis_url("unix://:pw@/run/redis/redis.sock?db=2")
    assert (target.socket_path, target.db, target.password, target.hosts) == ("/run/redis/redis.sock", 2, "pw", ())


def test_sentinels_with_a_service_and_a_database() -> None:
    url = "redis+sentinel://met:pw@s1:26380,s2,[::1]:26390/mymaster/4?sentinel_password=spw&sentinel_username=su"
    target = parse_redis_url(url)
    assert target.hosts == (("s1", 26380), ("s2", 26379), ("::1", 26390))
    assert (target.service, target.db, target.username, target.password) == ("mymaster", 4, "met", "pw")
    assert (target.sentinel_username, target.sentinel_password) == ("su", "spw")
    assert target.follows_failover and target.tls is None
    assert "pw" not in target.display() and "pw" not in repr(target)


def test_sentinels_over_tls() -> None:
    target = parse_redis_url("rediss+sentinel://s1:26379/svc?ssl_ca_certs=/ca.pem")
    assert target.tls == TlsOptions(ca_certs="/ca.pem") and target.db == 0


def test_a_cluster_from_its_startup_nodes() -> None:
    target = parse_redis_url("redis+cluster://met:pw@n1:7000,n2,[::1]:7002")
    assert target.hosts == (("n1", 7000), ("n2", 6379), ("::1", 7002))
    assert target.cluster and not target.follows_failover and target.db == 0 and target.tls is None
    assert (target.username, target.password) == ("met", "pw")
    assert "pw" not in target.display() and "pw" not in repr(target)
    assert parse_redis_url("redis+cluster://n1:7000/0").hosts == (("n1", 7000),)


def test_a_cluster_over_tls() -> None:
    target = parse_redis_url("rediss+cluster://n1:7000,n2:7001?ssl_ca_certs=/ca.pem")
    assert target.cluster and target.tls == TlsOptions(ca_certs="/ca.pem")


def test_only_a_cluster_url_is_a_cluster() -> None:
    assert not parse_redis_url("redis://h").cluster
    assert not parse_redis_url("redis+sentinel://s/svc").cluster


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://localhost", "starts with one of"),
        ("localhost:6379", "starts with one of"),
        ("redis://", "host is empty"),
        ("redis://host:0", "port must be"),
        ("redis://host:port", "port must be"),
        ("redis://host:70000", "port must be"),
        ("redis://host/x", "database is a number"),
        ("redis://h1,h2/0", "several hosts need"),
        ("redis+cluster://n1:7000/3", "database 0 alone"),
        ("redis+cluster://n1:7000/svc", "database 0 alone"),
        ("redis+cluster://n1:7000,", "host is empty"),
        ("redis+cluster://n1?sentinel_password=x", "only apply to"),
        ("redis+cluster://n1?ssl_ca_certs=/ca.pem", "need TLS"),
        ("redis://host?ssl_ca_certs=/ca.pem", "need TLS"),
        ("redis://host?socket_timeout=5", "unknown Redis URL parameter"),
        ("rediss://host?ssl_cert_reqs=maybe", "ssl_cert_reqs must be"),
        ("rediss://host?ssl_check_hostname=perhaps", "true or false"),
        ("rediss://host?ssl_ca_certs=a&ssl_ca_certs=b", "given twice"),
        ("redis://host?sentinel_password=x", "only apply to"),
        ("unix://relative.sock", "absolute socket path"),
        ("unix:///run/r.sock?db=one", "database is a number"),
        ("redis+sentinel://s1,s2", "names its service"),
        ("redis+sentinel://s1,s2/", "names its service"),
        ("redis+sentinel://s1,,s2/svc", "host is empty"),
        ("redis+sentinel://s1/svc/0/extra", "unexpected path"),
        ("redis+sentinel://s1/svc/zero", "database is a number"),
        ("redis+sentinel://[::1/svc", "malformed IPv6"),
    ],
)
def test_malformed_urls_are_refused_with_the_reason(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_redis_url(url)
