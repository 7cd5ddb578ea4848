"""Shared fixtures: one real server per session, a clean database per test, real workers.

Tests run against a real Redis/Valkey (see :mod:`celery_ext.testing.server`) because the
plugin's guarantees live in Lua scripts and AOF behaviour that no fake reproduces.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from celery_ext.testing.server import ClusterGroup, RedisServer
from celery_ext.worker.worker_pool import stop_all
from tests.workers import WorkerProcess

# pyproject passes `-p no:celery` (pytest-celery's plugin, whose celery_worker would replace
# Celery's); Celery's own fixtures come from celery.contrib.pytest, pytester runs the user
# projects of test_pytest_plugin.py, and celery_ext.pytest is our plugin (its entry point
# loads it too).
pytest_plugins = ("celery.contrib.pytest", "pytester", "celery_ext.pytest")


#: The marker of a test (or module, as ``pytestmark``) whose workers need no warm stop at
#: its end: see ``worker_factory``.
KILL_WORKERS = "kill_workers_at_teardown"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{KILL_WORKERS}: worker_factory SIGKILLs the test's workers at teardown "
        "(no warm stop) and flushes the session server")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Turn SIGTERM (e.g. a CI timeout) into KeyboardInterrupt so teardown and atexit
    still stop every server and worker instead of leaving them running."""
    if threading.current_thread() is threading.main_thread():

        def on_term(signum: int, frame: object) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, on_term)


@pytest.fixture(autouse=True)
def _stop_this_process_pools() -> Iterator[None]:
    """A test that consumes in this process (a Kombu consumer) starts this process's
    worker pool: heartbeat, reaper, requeuer. Stop it when the test ends, as the
    process's exit would, so it does not reap or promote in later tests."""
    yield
    stop_all()


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterGroup]:
    """A real local cluster: three masters with one replica each (the replicas serve
    the failover tests). Each test uses namespaces or queue names of its own."""
    with ClusterGroup(masters=3, replicas=1) as group:
        yield group


@pytest.fixture
def cluster_url(cluster: ClusterGroup) -> str:
    return cluster.url()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real server for the whole session (starting one per test would dominate runtime)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A bytes client on an empty server: FLUSHALL first, so tests never see each other's keys."""
    client = redis_server.client()
    client.flushall()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def rec(redis_server: RedisServer) -> redis.Redis:
    """db 2 of the session server, where the test apps' tasks record their runs."""
    return redis_server.client(db=2)


@pytest.fixture
def ext_client(broker_url: str, redis_client: redis.Redis) -> Iterator[Any]:
    """celery-ext's ``Client`` for the web test app (``tests.apps.proj_web``), configured
    for the session server, on an empty server."""
    from celery_ext.client import Client
    from tests.apps import proj_web

    proj_web.configure(broker_url)
    client = Client.for_app(proj_web.app)
    yield client
    client.client.close()


@pytest.fixture
def broker_url(redis_server: RedisServer) -> str:
    """The session server's URL with our transport's scheme (``import celery_ext`` registers it)."""
    return redis_server.url(scheme="celery-ext")


def _on(server: RedisServer, url: str) -> bool:
    """Whether broker ``url`` is ``server`` (one host and port, the server's)."""
    try:
        parts = urlsplit(url)
        return (parts.hostname, parts.port) == (server.host, server.port)
    except ValueError:  # several hosts (a cluster's seeds): not this one server
        return False


@pytest.fixture
def worker_factory(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., WorkerProcess]]:
    """Build :class:`WorkerProcess` objects (call ``.start()``); all are stopped at teardown
    (warm, SIGTERM; the session server's SIGKILLed under the ``kill_workers_at_teardown``
    marker).

    ``worker_factory("tasks.app", queues=[...])`` uses the ``broker_url`` fixture unless
    one is passed. Logs go to ``tmp_path``; their tails are printed at teardown, which
    pytest shows when the test fails.
    """
    workers: list[WorkerProcess] = []

    def make(app: str, broker_url: str | None = None, **kwargs: Any) -> WorkerProcess:
        url = broker_url if broker_url is not None else request.getfixturevalue("broker_url")
        worker = WorkerProcess(app, url, log_dir=tmp_path, **kwargs)
        workers.append(worker)
        return worker

    yield make

    if request.node.get_closest_marker(KILL_WORKERS) is not None and \
            "redis_server" in request.fixturenames:
        # The test asserted what it asserts; nothing reads what a warm stop would write
        # (a prefork pool takes about 2 s of it to stop its children). SIGKILL each group
        # of the session server's workers, then flush that server: the killed pools'
        # records, which a warm stop would have removed, reach no later test that does
        # not flush it itself. Workers of other servers (a module's, a cluster) stop warm.
        server: RedisServer = request.getfixturevalue("redis_server")
        killed = [w for w in workers if w.started and _on(server, w.broker_url)]
        for worker in killed:
            worker.stop(signal.SIGKILL, timeout=5)
            print(f"--- {worker.hostname} ({worker.log_path}):\n{worker.log_tail()}")
        if killed:
            with server.client() as client:
                client.flushall()
        workers = [w for w in workers if w not in killed]
    for worker in workers:
        worker.send(signal.SIGTERM)  # all at once: a gevent pool takes seconds to stop
    for worker in workers:
        if worker.started:
            # SIGTERM (SIGKILL after 15 s), then SIGKILL whatever is left in its group.
            worker.stop(signal.SIGTERM, timeout=15)
            print(f"--- {worker.hostname} ({worker.log_path}):\n{worker.log_tail()}")
