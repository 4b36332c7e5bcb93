"""``redis_connect``'s clients on real servers: TLS with a private CA and an ACL user (``rediss://``), and a
Unix socket (``unix://``); sentinels are in ``tests/failover/test_sentinel_clients.py``."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.asyncio.cluster

from metrale.shared.redis_connect import async_client, connect_async, connect_sync, is_cluster, sync_client, warm_pool
from tests.failover.processes import Process, free_port, spawn

PASSWORD = "s3cret/with:odd@chars"
QUOTED_PASSWORD = "s3cret%2Fwith%3Aodd%40chars"


@dataclass
class TlsServer:
    port: int
    ca: Path


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"this test needs {name}, and none is installed")
    return path


def _certificates(directory: Path) -> None:
    """A CA, and a server certificate for 127.0.0.1 it signs."""
    openssl = _binary("openssl")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=metrale-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "san.cnf")  # fmt: skip


def _serve(name: str, args: list[str], directory: Path, ready: redis.Redis) -> Process:
    common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(directory)]
    process = spawn(name, [_binary("redis-server"), *common, *args], os.environ, directory)

    def pings() -> bool:
        try:
            return bool(ready.ping())
        except redis.ConnectionError:
            return False

    process.wait_until(pings, f"{name} to answer", timeout_s=20)
    return process


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TlsServer]:
    """A TLS-only ``redis-server`` with the user ``met`` allowed the ``met:*`` keys."""
    _certificates(tmp_path)
    port = free_port()
    tls = ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"]
    tls += ["--tls-cert-file", str(tmp_path / "server.pem"), "--tls-key-file", str(tmp_path / "server.key")]
    tls += ["--tls-ca-cert-file", str(tmp_path / "ca.pem")]
    admin = redis.Redis(port=port, ssl=True, ssl_ca_certs=str(tmp_path / "ca.pem"), socket_connect_timeout=0.5)
    process = _serve("redis-tls", tls, tmp_path, admin)
    admin.execute_command("ACL", "SETUSER", "met", "on", f">{PASSWORD}", "~met:*", "+@all")
    admin.close()
    try:
        yield TlsServer(port, tmp_path / "ca.pem")
    finally:
        process.stop()


def test_tls_with_a_private_ca_and_an_acl_user(tls_server: TlsServer) -> None:
    url = f"rediss://met:{QUOTED_PASSWORD}@127.0.0.1:{tls_server.port}/0?ssl_ca_certs={tls_server.ca}"
    client = sync_client(url)
    client.set("met:tls", "sync")
    assert client.acl_whoami() == "met" and client.get("met:tls") == b"sync"
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.get("other:key")
    client.close()

    async def over_asyncio() -> bytes | None:
        client = async_client(url)
        try:
            await client.set("met:tls", "async")
            return await client.get("met:tls")
        finally:
            await client.aclose()

    assert asyncio.run(over_asyncio()) == b"async"


def test_tls_refuses_a_server_its_ca_did_not_sign_unless_told_not_to_check(tls_server: TlsServer) -> None:
    base = f"rediss://met:{QUOTED_PASSWORD}@127.0.0.1:{tls_server.port}/0"
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate"):
        sync_client(base, retries=0).ping()  # the system's CAs do not know ours
    unchecked = sync_client(f"{base}?ssl_cert_reqs=none", retries=0)
    assert unchecked.ping()
    unchecked.close()


def test_a_wrong_password_is_an_authentication_error(tls_server: TlsServer) -> None:
    url = f"rediss://met:wrong@127.0.0.1:{tls_server.port}/0?ssl_ca_certs={tls_server.ca}"
    with pytest.raises(redis.exceptions.AuthenticationError):
        sync_client(url, retries=0).ping()


def test_a_unix_socket_and_its_database(tmp_path: Path) -> None:
    socket_path = tmp_path / "redis.sock"
    ready = redis.Redis(unix_socket_path=str(socket_path), socket_connect_timeout=0.5)
    process = _serve("redis-unix", ["--port", "0", "--unixsocket", str(socket_path)], tmp_path, ready)
    try:
        client = sync_client(f"unix://{socket_path}?db=2")
        client.set("met:unix", "1")
        with redis.Redis(unix_socket_path=str(socket_path), db=2) as database_2:
            assert database_2.get("met:unix") == b"1" and ready.get("met:unix") is None
        client.close()
    finally:
        ready.close()
        process.stop()


def test_a_warmed_pool_has_its_connections_open_before_any_command(real_redis_url: str) -> None:
    async def warmed() -> tuple[int, int, int, int]:
        client = async_client(real_redis_url, max_connections=16)
        try:
            before = _clients(real_redis_url)
            opened = await warm_pool(client, 12)
            during = _clients(real_redis_url)
            await asyncio.gather(*(client.ping() for _ in range(12)))  # served by the open ones
            after = _clients(real_redis_url)
            return opened, during - before, after - before, len(client.connection_pool._available_connections)
        finally:
            await client.aclose()

    opened, open_after_warming, open_after_commands, idle = asyncio.run(warmed())
    assert (opened, open_after_warming, idle) == (12, 12, 12)
    assert open_after_commands == 12  # the commands made none of their own


def test_warming_a_pool_past_its_cap_opens_what_the_cap_allows(real_redis_url: str) -> None:
    async def warmed() -> int:
        client = async_client(real_redis_url, max_connections=4)
        try:
            return await warm_pool(client, 10)
        finally:
            await client.aclose()

    assert asyncio.run(warmed()) == 4


def _clients(url: str) -> int:
    """The connections the server at ``url`` has open now."""
    with redis.Redis.from_url(url) as client:
        return int(client.info("clients")["connected_clients"])


def test_connect_gives_the_cluster_client_for_a_cluster_url_and_the_plain_one_otherwise() -> None:
    plain = connect_sync("redis://127.0.0.1:1/3")
    assert isinstance(plain, redis.Redis) and not is_cluster(plain)
    assert plain.connection_pool.connection_kwargs["db"] == 3
    aplain = connect_async("redis://127.0.0.1:1")
    assert isinstance(aplain, redis.asyncio.Redis) and not is_cluster(aplain)
    # The asyncio cluster client connects lazily: it can be made without a node answering.
    acluster = connect_async("redis+cluster://127.0.0.1:1,127.0.0.1:2")
    assert isinstance(acluster, redis.asyncio.cluster.RedisCluster) and is_cluster(acluster)
    # The sync one reads the slot map at once: no node answers here.
    with pytest.raises(redis.exceptions.RedisClusterException):
        connect_sync("redis+cluster://127.0.0.1:1", retries=0, socket_connect_timeout=0.2)
