"""``compose.yaml`` and the ``Dockerfile`` describe a fleet that can run: every command they give is a
real ``met`` command with real options, the workers scale, share a volume with the gateway, have
health checks, and take their settings from ``MET_*`` variables that exist. ``docker compose config``
checks the file too where Docker Compose is installed."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from metrale.cli.main import app
from metrale.shared.keys import Keys
from metrale.shared.redis_connect import connect_sync
from metrale.shared.redis_url import parse_redis_url
from metrale.shared.settings import MetraleSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
MET_SERVICES = ("gateway", "worker", "worker-gpu")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(document, dict)
    return document


def parse_met(args: list[str]) -> dict[str, Any]:
    """Parse ``met ARGS`` with the real command tree, as the CLI would, without running it; return the
    parameters of the command reached. Raises on an unknown command, option or value."""
    command: Any = typer.main.get_command(app)
    context = command.make_context("met", [], resilient_parsing=True)
    while hasattr(command, "resolve_command"):  # a group: descend to the subcommand
        name, command, args = command.resolve_command(context, list(args))
        if command is None:
            raise ValueError(f"no such command: met {name}")
        context = command.make_context(name, list(args), parent=context, resilient_parsing=False)
    return dict(context.params)


def test_the_command_parser_refuses_what_met_refuses() -> None:
    assert parse_met(["worker", "--device", "cuda"])["device"] == "cuda"
    for wrong in (["worker", "--no-such-flag"], ["worker", "--device", "tpu"], ["no-such-command"]):
        with pytest.raises(Exception):  # noqa: B017  # click's and typer's errors have no common public base
            parse_met(wrong)


@pytest.mark.parametrize("service", MET_SERVICES)
def test_every_service_runs_a_real_met_command(compose: dict[str, Any], service: str) -> None:
    command = compose["services"][service]["command"]
    assert command[0] == "met"
    parse_met(command[1:])


def test_the_dockerfile_installs_met_and_runs_nothing_by_itself() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11", text, re.MULTILINE)
    assert "pip install" in text and "COPY metrale ./metrale" in text
    assert re.search(r"^ENTRYPOINT \[\]$", text, re.MULTILINE)


def test_workers_scale_and_share_the_gateways_volume(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"redis", "gateway", "worker"} <= set(services)
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker  # --scale worker=N needs both absent
    assert services["gateway"]["ports"]
    mounts = {service: services[service]["volumes"] for service in MET_SERVICES}
    assert all(volume == mounts["gateway"] for volume in mounts.values())
    (volume,) = mounts["gateway"]
    assert volume.split(":")[0] in compose["volumes"]
    for service in MET_SERVICES:
        assert services[service]["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("service", ["redis", *MET_SERVICES])
def test_every_service_has_a_health_check_that_parses(compose: dict[str, Any], service: str) -> None:
    check = compose["services"][service]["healthcheck"]["test"]
    assert check[0] == "CMD"
    if check[1] == "python":
        assert check[2] == "-c"
        compile(check[3], f"{service} healthcheck", "exec")


def test_settings_come_from_met_variables_that_exist(compose: dict[str, Any]) -> None:
    known = {f"MET_{name.upper()}" for name in MetraleSettings.model_fields}
    for service in MET_SERVICES:
        environment = compose["services"][service]["environment"]
        assert set(environment) <= known, set(environment) - known
        assert environment["MET_REDIS_URL"] == "${MET_REDIS_URL:-redis://redis:6379/0}"
        assert environment["MET_DRAIN_HANDOFF"].endswith("true}")


def test_the_gpu_profile_reserves_a_gpu_and_the_default_runs_on_cpu(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and "--device" in gpu["command"] and "cuda" in gpu["command"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    assert "profiles" not in services["worker"] and parse_met(services["worker"]["command"][1:])["device"] == "cpu"


def test_docker_compose_accepts_the_file_where_it_is_installed() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("Docker Compose is not installed here; the structural checks above stand in for it")
    check = [docker, "compose", "-f", str(COMPOSE), "config", "--quiet"]
    result = subprocess.run(check, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_ha_profile_adds_a_replica_and_three_sentinels_that_watch_the_primary(compose: dict[str, Any]) -> None:
    services = compose["services"]
    sentinels = [name for name in services if name.startswith("sentinel-")]
    assert len(sentinels) == 3
    replica = services["redis-replica"]
    assert replica["profiles"] == ["ha"] and "profiles" not in services["redis"]
    command = replica["command"]
    assert command[command.index("--replicaof") + 1 : command.index("--replicaof") + 3] == ["redis", "6379"]
    assert replica["volumes"][0].split(":")[0] in compose["volumes"]
    for name in sentinels:
        sentinel = services[name]
        assert sentinel["profiles"] == ["ha"] and sentinel["healthcheck"]["test"][-1] == "ping"
        script = sentinel["command"][-1]
        monitor = re.search(r"'sentinel monitor (\S+) (\S+) (\d+) (\d+)'", script)
        assert monitor is not None and monitor.group(2, 3) == ("redis", "6379")
        assert int(monitor.group(4)) == len(sentinels) // 2 + 1  # a majority agrees the primary is down
        assert "exec redis-sentinel" in script
    service = monitor.group(1)
    url = f"redis+sentinel://{','.join(sentinels)}/{service}"
    assert url in COMPOSE.read_text()  # the command in the header that points MET_REDIS_URL at them
    target = parse_redis_url(url)
    assert [host for host, _ in target.hosts] == sentinels and target.service == service


def test_the_worker_health_check_finds_this_hosts_live_worker(compose: dict[str, Any], any_redis_url: str) -> None:
    """The check, run as the container runs it, on one Redis and on a Redis Cluster: healthy only while a
    worker of this host keeps its heartbeat key (another host's worker, or an index entry whose key
    expired, is not this container's)."""
    check = compose["services"]["worker"]["healthcheck"]["test"][3]
    namespace = f"met-health-{uuid.uuid4().hex[:8]}"
    keys = Keys.for_redis(any_redis_url, namespace)
    client = connect_sync(any_redis_url)
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64]
    environment = os.environ | {"MET_REDIS_URL": any_redis_url, "MET_NAMESPACE": namespace}

    def healthy() -> bool:
        done = subprocess.run([sys.executable, "-c", check], env=environment, capture_output=True, timeout=60)
        assert done.returncode in (0, 1), done.stderr.decode()
        return done.returncode == 0

    def index(worker_id: str, *, alive: bool) -> None:
        client.zadd(keys.worker_index(), {worker_id: time.time()})
        if alive:
            client.hset(keys.worker(worker_id), "msg", b"beat")

    try:
        assert not healthy()
        index("elsewhere-1", alive=True)
        index(f"{host}-lost", alive=False)
        assert not healthy()
        index(f"{host}-live", alive=True)
        assert healthy()
    finally:
        client.delete(keys.worker_index(), keys.worker("elsewhere-1"), keys.worker(f"{host}-live"))
        client.close()


def test_the_cluster_profile_joins_three_primaries_each_with_a_replica(compose: dict[str, Any]) -> None:
    services = compose["services"]
    nodes = [name for name in services if re.fullmatch(r"redis-cluster-\d+", name)]
    assert len(nodes) == 6
    volumes = set()
    for name in nodes:
        node = services[name]
        assert node["profiles"] == ["cluster"] and node["hostname"] == name
        assert node["healthcheck"]["test"][-1] == "ping"
        command = node["command"][-1]
        assert "--cluster-enabled yes" in command and "--cluster-preferred-endpoint-type hostname" in command
        (volume,) = node["volumes"]
        volumes.add(volume.split(":")[0])
    assert len(volumes) == 6 and volumes <= set(compose["volumes"])  # a node's nodes.conf is its own
    create = services["redis-cluster-create"]
    assert create["profiles"] == ["cluster"] and create["restart"] == "no"
    assert set(create["depends_on"]) == set(nodes)
    assert all(condition == {"condition": "service_healthy"} for condition in create["depends_on"].values())
    script = create["command"][-1]
    assert "redis-cli --cluster create $$nodes --cluster-replicas 1 --cluster-yes" in script
    numbers = re.search(r"for n in ([\d ]+); do", script)
    assert numbers is not None and [f"redis-cluster-{n}" for n in numbers.group(1).split()] == nodes
    url = re.search(r"MET_REDIS_URL=(redis\+cluster://\S+)", COMPOSE.read_text())
    assert url is not None
    target = parse_redis_url(url.group(1))
    assert target.cluster and {host for host, _ in target.hosts} <= set(nodes)
    assert "profiles" not in services["redis"]
