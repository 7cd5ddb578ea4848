"""compose/: the stack file is valid Compose and keeps the broker's promises.

No Docker engine here: Debian's ``docker-compose`` (installed with apt-get when
missing, like the browser test's chromium) validates the file against its Compose
specification schema and resolves it with ``config``, which needs no engine. The
resolved file is then checked for what the README promises: AOF on, noeviction,
health checks that ask the real thing, restart policies, one image built from
compose/Dockerfile. The server configuration it mounts (``config/valkey.conf``) is
loaded by a real server. The cluster variant (``docker-compose.cluster.yml``) is checked
the same way, and its node commands (``config/valkey-cluster.conf``) and one-shot init
script are run against real servers to build a cluster that takes writes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from redis.crc import key_slot

from celery_ext.testing.server import find_cli_binary, find_server_binary
from tests.debian import ensure_installed
from tests.deploy_config import CONFIG, installed, server
from tests.helpers import Factory, free_port, wait_for
from tests.workers import REPO_ROOT, ManagedProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

COMPOSE = REPO_ROOT / "compose"
FILE = COMPOSE / "docker-compose.yml"
APP_SERVICES = ("worker", "dashboard", "flower")


def _ensure_docker_compose() -> str:
    """Debian's docker-compose, installed with apt-get when missing; skip if impossible."""
    found = shutil.which("docker-compose")
    if found:
        return found
    try:
        return ensure_installed("docker-compose", "/usr/bin/docker-compose", recommends=False)
    except LookupError as exc:
        pytest.skip(str(exc))


def compose_config(path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``docker-compose -f path config`` with no engine reachable."""
    full_env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock", **env}
    return subprocess.run([_ensure_docker_compose(), "-f", str(path), "config"],
                          cwd=REPO_ROOT, env=full_env, capture_output=True, text=True,
                          timeout=120)


def resolve(path: Path) -> dict[str, Any]:
    """A stack file as Compose resolves it (anchors merged, variables filled in)."""
    result = compose_config(path, CELERY_EXT_DASHBOARD_TOKEN="s3cret")
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    return resolve(FILE)


def test_the_validator_rejects_what_the_specification_does(tmp_path: Path) -> None:
    """The same file with one field the specification does not allow fails, so a pass
    means something."""
    broken = yaml.safe_load(FILE.read_text())
    broken["services"]["worker"]["healthcheck"]["every"] = "5s"
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = compose_config(path, CELERY_EXT_DASHBOARD_TOKEN="s3cret")
    assert result.returncode != 0
    assert "every" in result.stderr


def test_the_dashboard_token_is_required() -> None:
    result = compose_config(FILE)
    assert result.returncode != 0
    assert "CELERY_EXT_DASHBOARD_TOKEN" in result.stderr


def test_every_service_restarts_and_has_a_health_check(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert set(services) == {"valkey", *APP_SERVICES}
    for name, service in services.items():
        assert service["restart"] in ("unless-stopped", "always"), name
        test = service["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name
    check = {name: " ".join(s["healthcheck"]["test"][1:]) for name, s in services.items()}
    assert "valkey-cli ping" in check["valkey"] and "PONG" in check["valkey"]
    # A pool's check pings that pool by its own node name (the container's hostname).
    assert "-n" in services["worker"]["command"]
    node = services["worker"]["command"][services["worker"]["command"].index("-n") + 1]
    assert node == "worker@%h"
    assert "inspect ping -d worker@$$HOSTNAME" in check["worker"]
    assert "/api/health" in check["dashboard"] and "['ok']" in check["dashboard"]
    assert "/healthcheck" in check["flower"]
    for name in APP_SERVICES:
        assert services[name]["depends_on"]["valkey"]["condition"] == "service_healthy"
    assert services["worker"]["deploy"]["replicas"] >= 2


def test_the_app_services_run_the_image_built_from_compose_dockerfile(
        resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    images = set()
    for name in APP_SERVICES:
        build = services[name]["build"]
        assert Path(build["context"]).resolve() == REPO_ROOT.resolve(), name
        assert (Path(build["context"]) / build["dockerfile"]).resolve() \
            == (COMPOSE / "Dockerfile").resolve(), name
        images.add(services[name]["image"])
        assert services[name]["environment"]["CELERY_EXT_BROKER_URL"].startswith(
            "celery-ext://valkey:6379/")
    assert len(images) == 1  # one image, built once
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    for part in ("celery_ext", "tasks"):
        assert f"COPY {part} " in dockerfile
    # Flower's config file, with the line that gives Flower our broker page.
    assert "COPY compose/flowerconfig.py ./flowerconfig.py" in dockerfile
    assert "WORKDIR /app" in dockerfile
    assert services["flower"]["command"][-1] == "--conf=/app/flowerconfig.py"
    assert "[web,flower]" in dockerfile


def _conf(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key] = value.strip()
    return out


def test_valkey_is_durable_and_never_evicts(resolved: dict[str, Any], tmp_path: Path) -> None:
    valkey = resolved["services"]["valkey"]
    mounts = {v.split(":")[1]: Path(v.split(":")[0]) for v in valkey["volumes"]}
    assert mounts["/etc/valkey"].resolve() == CONFIG.resolve()  # config/, the one copy
    assert valkey["command"][-1] == "/etc/valkey/valkey.conf"
    conf_path = CONFIG / "valkey.conf"
    assert "/data" in mounts  # the AOF lives on a named volume
    conf = _conf(conf_path.read_text())
    assert conf["appendonly"] == "yes" and conf["appendfsync"] == "always"
    assert conf["maxmemory-policy"] == "noeviction"

    # A real server loads the file as it is (only where to listen and write changed).
    with server(conf_path, tmp_path / "valkey") as client:
        live = {k: v for k in ("appendonly", "appendfsync", "maxmemory-policy", "maxmemory",
                               "replica-read-only", "min-replicas-to-write")
                for k, v in client.config_get(k).items()}
        assert live == {"appendonly": "yes", "appendfsync": "always",
                        "maxmemory-policy": "noeviction", "maxmemory": str(1 << 30),
                        "replica-read-only": "yes", "min-replicas-to-write": "0"}
        assert client.set("job", "accepted")  # a single node takes writes with no replica


def test_the_health_checks_pass_against_real_services_and_fail_for_another_pool(
        resolved: dict[str, Any], worker_factory: Factory, broker_url: str,
        redis_client: redis.Redis, tmp_path: Path) -> None:
    """The worker's and the dashboard's health-check commands, run as the containers
    would (Docker sets HOSTNAME; Compose turns ``$$`` into ``$``), against a real pool
    and a real dashboard of the example app."""
    services = resolved["services"]
    host = socket.gethostname()
    env = {**os.environ, "CELERY_EXT_BROKER_URL": broker_url, "PYTHONPATH": str(REPO_ROOT),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           "CELERY_EXT_WEB_TOKEN": "s3cret"}
    worker_check = services["worker"]["healthcheck"]["test"][1].replace("$$", "$")
    node = services["worker"]["command"][services["worker"]["command"].index("-n") + 1]
    worker_factory("tasks", hostname=node, concurrency=1).start()
    port = free_port()
    # The container's command, on loopback and a free port here.
    argv = [a.replace("0.0.0.0", "127.0.0.1") for a in services["dashboard"]["command"][:-1]]
    web = ManagedProcess([sys.executable, "-m", *argv, str(port)], log_path=tmp_path / "web.log",
                         env=env, ready_pattern=r"Uvicorn running on")
    try:
        web.start(timeout=30)

        def run(argv: list[str], **more: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(argv, cwd=REPO_ROOT, env={**env, **more}, capture_output=True,
                                  text=True, timeout=60)

        ok = run(["sh", "-c", worker_check], HOSTNAME=host)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        # Another pool's name (its container) gets no answer from this pool.
        other = run(["sh", "-c", worker_check.replace("-t 10", "-t 2")], HOSTNAME="elsewhere")
        assert other.returncode != 0

        web_check = [a.replace("5040", str(port)) for a in services["dashboard"]["healthcheck"]
                     ["test"][1:]]
        web_check[0] = sys.executable  # the container's `python`
        healthy = run(web_check)
        assert healthy.returncode == 0, healthy.stderr
        assert run(web_check, CELERY_EXT_WEB_TOKEN="wrong").returncode != 0
    finally:
        web.stop(timeout=10)


def test_the_flower_service_shows_true_queue_lengths(
        resolved: dict[str, Any], worker_factory: Factory, broker_url: str,
        redis_client: redis.Redis, tmp_path: Path) -> None:
    """The Flower service's command, run as the container would (its config file at
    the path the image gives it replaced by compose/flowerconfig.py), against a real
    pool of the example app: its health check passes and /api/queues/length reports a
    job queue's true length, which Flower has only through that config file's line."""
    pytest.importorskip("flower", reason="flower is not installed")
    from celery import Celery

    import celery_ext
    from celery_ext.client import Client

    flower_service = resolved["services"]["flower"]
    worker_factory("tasks", concurrency=1).start()
    port = free_port()
    argv = [a.replace("5555", str(port)).replace("/app/flowerconfig.py",
                                                 str(COMPOSE / "flowerconfig.py"))
            for a in flower_service["command"][1:]]
    env = {**os.environ, "CELERY_EXT_BROKER_URL": broker_url, "PYTHONPATH": str(REPO_ROOT),
           "FLOWER_UNAUTHENTICATED_API": "1"}
    flower = ManagedProcess([sys.executable, "-m", "celery", *argv, "--address=127.0.0.1"],
                            log_path=tmp_path / "flower.log", cwd=tmp_path, env=env,
                            ready_pattern=r"Visit me at")
    producer = celery_ext.install(Celery("producer", broker=broker_url))
    client = Client.from_url(broker_url)
    name = "celery_ext.demo.app.send_notice"  # the example app's short job
    try:
        client.pause(name)
        for i in range(3):
            producer.send_task(name, (i,))
        flower.start(timeout=30)
        check = [a.replace("5555", str(port)) for a in flower_service["healthcheck"]["test"][1:]]
        check[0] = sys.executable  # the container's `python`
        assert subprocess.run(check, capture_output=True, timeout=30).returncode == 0

        def lengths() -> dict[str, Any] | None:
            # Flower lists the queues its last look at the workers found (until it has
            # one, the default queue only).
            base = f"http://127.0.0.1:{port}/api"
            with urllib.request.urlopen(f"{base}/workers?refresh=1", timeout=10):
                pass
            with urllib.request.urlopen(f"{base}/queues/length", timeout=10) as reply:
                queues = {q["name"]: q for q in json.loads(reply.read())["active_queues"]}
            return queues.get(name)

        queue = wait_for(lengths, 30, "Flower's length of the example app's job queue")
        assert (queue["messages_ready"], queue["consumers"]) == (3, 1)
    finally:
        client.resume(name)
        flower.stop(timeout=10)


# -- the cluster variant -----------------------------------------------------------------------

CLUSTER_FILE = COMPOSE / "docker-compose.cluster.yml"
NODES = tuple(f"valkey-{n}" for n in range(1, 7))


@pytest.fixture(scope="module")
def cluster_resolved() -> dict[str, Any]:
    return resolve(CLUSTER_FILE)


def test_the_cluster_file_is_valid_and_needs_the_token(tmp_path: Path) -> None:
    assert "CELERY_EXT_DASHBOARD_TOKEN" in compose_config(CLUSTER_FILE).stderr
    broken = yaml.safe_load(CLUSTER_FILE.read_text())
    broken["services"]["cluster-init"]["restart_when"] = "never"
    path = tmp_path / "docker-compose.cluster.yml"
    path.write_text(yaml.safe_dump(broken))
    result = compose_config(path, CELERY_EXT_DASHBOARD_TOKEN="s3cret")
    assert result.returncode != 0 and "restart_when" in result.stderr


def test_the_cluster_nodes_are_durable_and_each_has_its_own_data(
        cluster_resolved: dict[str, Any]) -> None:
    services = cluster_resolved["services"]
    assert set(services) == {*NODES, "cluster-init", "results", *APP_SERVICES}
    data = set()
    for name in NODES:
        node = services[name]
        mounts = {v.split(":")[1]: v.split(":")[0] for v in node["volumes"]}
        # config/, the one copy (valkey.conf's AOF and noeviction: checked above).
        assert Path(mounts["/etc/valkey"]).resolve() == CONFIG.resolve(), name
        data.add(mounts["/data"])
        command = " ".join(node["command"])
        assert "valkey-server /etc/valkey/valkey-cluster.conf " in command, name
        assert "valkey-cli ping" in " ".join(node["healthcheck"]["test"]), name
        assert node["restart"] == "unless-stopped" and node["hostname"] == name
    assert len(data) == len(NODES)  # no two nodes share an AOF

    init = services["cluster-init"]
    script = init["command"][-1]
    assert "--cluster create " + " ".join(f"{n}:6379" for n in NODES) in script
    assert "--cluster-replicas 1" in script  # 6 nodes: 3 masters + 1 replica each
    assert init["restart"] == "no"
    assert {n: c["condition"] for n, c in init["depends_on"].items()} == dict.fromkeys(
        NODES, "service_healthy")


def test_the_cluster_apps_use_the_cluster_option(cluster_resolved: dict[str, Any]) -> None:
    services = cluster_resolved["services"]
    for name in APP_SERVICES:
        service = services[name]
        env = service["environment"]
        assert env["CELERY_EXT_CLUSTER"] == "1", name
        seeds = env["CELERY_EXT_BROKER_URL"].split(";")
        assert seeds and all(s.startswith("celery-ext://valkey-") and s.endswith(":6379/0")
                             for s in seeds), name
        assert not env["CELERY_EXT_RESULT_BACKEND"].startswith("redis://valkey-"), name
        assert service["depends_on"]["cluster-init"]["condition"] \
            == "service_completed_successfully", name
        assert (Path(service["build"]["context"]) / service["build"]["dockerfile"]).resolve() \
            == (COMPOSE / "Dockerfile").resolve(), name
    # Workers and Flower run on the cluster like the dashboard: nothing is left to a profile.
    assert not any("profiles" in services[name] for name in ("worker", "flower", "dashboard"))


def test_the_cluster_node_and_init_commands_build_a_real_cluster(
        cluster_resolved: dict[str, Any], tmp_path: Path) -> None:
    """Each node's command and the init service's script, run as the containers would
    (their names replaced by loopback ports, config/ installed where they read it), make a
    working 3-master cluster whose masters take writes once the init is done (each has a
    replica in sync: min-replicas-to-write); a second run of the init leaves it alone."""
    services = cluster_resolved["services"]
    binary = Path(find_server_binary())
    cli = Path(find_cli_binary())
    etc = installed(tmp_path / "etc")
    ports = {name: free_port() for name in NODES}
    procs = []
    try:
        for name in NODES:
            script = services[name]["command"][-1].replace("$$", "$")
            script = script.replace("valkey-server ", f"{binary} ", 1).replace(
                "/etc/valkey/", f"{etc}/")
            data = tmp_path / name
            data.mkdir()
            script += (f" --port {ports[name]} --bind 127.0.0.1 --dir {data}"
                       f" --cluster-port {free_port()}")
            procs.append(subprocess.Popen(
                ["sh", "-c", script], env={**os.environ, "HOSTNAME": name},
                stdin=subprocess.DEVNULL, stdout=(data / "log").open("wb"),
                stderr=subprocess.STDOUT))
        clients = [redis.Redis(port=p, socket_timeout=2, decode_responses=True)
                   for p in ports.values()]

        def up() -> bool:
            try:
                return all(c.ping() for c in clients)
            except redis.ConnectionError:
                return False

        wait_for(up, 15, "the cluster nodes")
        init = services["cluster-init"]["command"][-1].replace("$$", "$").replace(
            "valkey-cli", str(cli))
        for name, port in ports.items():
            init = init.replace(f"-h {name} ", f"-h 127.0.0.1 -p {port} ")
            init = init.replace(f"{name}:6379", f"127.0.0.1:{port}")
        for _ in range(2):  # the second run finds the cluster and leaves it alone
            done = subprocess.run(["timeout", "60", "sh", "-c", init], capture_output=True,
                                  text=True, timeout=70)
            assert done.returncode == 0, done.stdout + done.stderr
        roles = [c.info("replication")["role"] for c in clients]
        assert sorted(roles) == ["master"] * 3 + ["slave"] * 3
        assert all(c.config_get("appendonly")["appendonly"] == "yes" for c in clients)
        assert all(c.config_get("min-replicas-to-write")["min-replicas-to-write"] == "1"
                   for c in clients)
        assert clients[0].cluster("info")["cluster_state"] == "ok"
        # The init waited for every master's replica: each master takes a write now.
        masters = 0
        for line in clients[0].execute_command("CLUSTER", "NODES").splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            low, high = (int(n) for n in fields[8].split("-"))
            key = next(k for k in (f"job-{i}" for i in range(100_000))
                       if low <= key_slot(k.encode()) <= high)
            master = redis.Redis(port=int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                                 socket_timeout=2, decode_responses=True)
            try:
                assert master.set(key, "accepted"), fields[1]
            finally:
                master.close()
            masters += 1
        assert masters == 3

        def aof_written() -> bool:
            return all(not int(c.info("persistence")["aof_rewrite_in_progress"])
                       and not int(c.info("persistence")["aof_rewrite_scheduled"])
                       for c in clients)

        # A replica fresh from its full sync writes its initial AOF; a SIGTERM then is
        # refused ("Writing initial AOF, can't exit") and the server runs on.
        wait_for(aof_written, 15, "every node's initial AOF")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:  # the test failed before the wait above
                proc.kill()
                proc.wait()
