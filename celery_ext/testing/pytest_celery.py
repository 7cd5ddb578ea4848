"""pytest-celery without Docker: broker, backend and worker nodes backed by local processes.

pytest-celery's nodes (``CeleryTestBroker``, ``CeleryTestBackend``, ``CeleryTestWorker``)
only delegate to a ``container`` object; the containers here are a local server and a
``celery worker`` subprocess, so ``celery_setup`` and its helpers run against celery-ext
with no Docker engine (pytest-celery's ``docker`` packages must still be importable).
In a user's ``conftest.py``, beside the plugin ``celery_ext.pytest``::

    from celery_ext.testing.pytest_celery import *  # noqa: F403

The broker and backend are the plugin's session server (``celery_ext_server``), the
broker in the test's own namespace; ``celery_setup.app`` is the app under test (the ini
option ``celery_ext_app``) configured for them, and the worker is ``celery -A <that app>
worker`` with pytest-celery's ``ping`` task included, started for the test and stopped
after it. What needs a container's process table (``CeleryTestWorker.
get_running_processes_info``) raises ``NotImplementedError``; killing or restarting the
shared session server is refused the same way (the worker can be killed and restarted).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery
import pytest
from pytest_celery.api.backend import CeleryBackendCluster, CeleryTestBackend
from pytest_celery.api.broker import CeleryBrokerCluster, CeleryTestBroker
from pytest_celery.api.setup import CeleryTestSetup
from pytest_celery.api.worker import CeleryTestWorker, CeleryWorkerCluster

from celery_ext.install import install
from celery_ext.testing.fixtures import TestServer

#: pytest-celery's readiness check sends this task to every worker.
PING_TASKS_MODULE = "pytest_celery.vendors.worker.tasks"
#: The worker's node name is ``<WORKER_NAME>@<container id>``, as pytest-celery builds it.
WORKER_NAME = "celery_ext_worker"
#: Seconds a worker has to log "ready" after it starts, and to exit after SIGTERM.
WORKER_START_TIMEOUT = 60.0
WORKER_STOP_TIMEOUT = 20.0

__all__ = [
    "CeleryExtSetup",
    "LocalServer",
    "LocalWorker",
    "celery_backend_cluster",
    "celery_broker_cluster",
    "celery_setup_app",
    "celery_setup_cls",
    "celery_worker_cluster",
]


class LocalServer:
    """The container of a broker or backend node: the session's server, shared by the
    session's tests (so it is never killed or restarted by one of them)."""

    def __init__(self, server: TestServer, scheme: str) -> None:
        self.server = server
        self.scheme = scheme
        self.id = uuid.uuid4().hex[:12]
        self.name = f"celery_ext_{scheme.replace('-', '_')}_{self.id}"
        self.status = "running"

    @property
    def client(self) -> Any:
        return self.server.client()

    @property
    def celeryconfig(self) -> dict[str, Any]:
        url = self.server.url(self.scheme)
        return {"url": url, "host_url": url, "hostname": self.server.host,
                "port": self.server.port, "vhost": str(self.server.db)}

    def ready(self) -> bool:
        client = self.client
        try:
            return bool(client.ping())
        finally:
            client.close()

    def logs(self) -> str:
        return ""

    def reload(self) -> None:
        """Nothing to refresh: the state is read when asked."""

    def kill(self, signal: str | int = "SIGKILL") -> None:
        raise NotImplementedError("celery_ext: the session's server is shared by every test; "
                                  "it is not killed by one (kill the worker node instead)")

    def restart(self, timeout: float = 0) -> None:
        raise NotImplementedError("celery_ext: the session's server is shared by every test; "
                                  "it is not restarted by one")

    def teardown(self) -> None:
        """The session fixture stops the server."""


class LocalWorker:
    """The container of a worker node: ``celery -A <app> worker`` in a subprocess."""

    def __init__(self, app_path: str, broker_url: str, backend_url: str, namespace: str,
                 log_path: Path, pool: str = "prefork", concurrency: int = 1,
                 env: dict[str, str] | None = None) -> None:
        self.app_path = app_path
        self.broker_url = broker_url
        self.backend_url = backend_url
        self.namespace = namespace
        self.log_path = log_path
        self.pool = pool
        self.concurrency = concurrency
        self.env = env or {}
        self.id = uuid.uuid4().hex[:12]
        self.name = f"{WORKER_NAME}_{self.id}"
        self._process: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # -- what pytest-celery's worker node reads --------------------------------------
    def version(self) -> str:
        return str(celery.__version__)

    def log_level(self) -> str:
        return "INFO"

    def worker_name(self) -> str:
        return WORKER_NAME

    def worker_queue(self) -> str:
        return "celery"

    @property
    def celeryconfig(self) -> dict[str, Any]:
        return {}

    @property
    def status(self) -> str:
        return "running" if self._process is not None and self._process.poll() is None \
            else "exited"

    def exec_run(self, cmd: Any) -> Any:
        raise NotImplementedError("celery_ext: a local worker has no container to run "
                                  "commands in (process listings need pytest-celery's "
                                  "Docker worker)")

    # -- life ------------------------------------------------------------------------
    def start(self) -> LocalWorker:
        argv = [sys.executable, "-m", "celery", "-A", self.app_path,
                "-b", self.broker_url, "--result-backend", self.backend_url,
                "worker", "-P", self.pool, "-c", str(self.concurrency),
                "-n", f"{WORKER_NAME}@{self.id}", "-l", "INFO",
                "--include", PING_TASKS_MODULE, "--without-mingle", "--without-gossip"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "CELERY_EXT_NAMESPACE": self.namespace,
               "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), *sys.path) if p),
               **self.env}
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env,
                                             start_new_session=True)
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def ready(self) -> bool:
        """Waits until this start of the worker logs "ready" (or fails)."""
        deadline = time.monotonic() + WORKER_START_TIMEOUT
        while time.monotonic() < deadline:
            if " ready." in self.logs()[self._log_offset:]:
                return True
            if self.status != "running":
                raise RuntimeError(f"celery_ext: worker {self.name} exited at start:\n"
                                   f"{self.logs()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"celery_ext: worker {self.name} not ready in "
                           f"{WORKER_START_TIMEOUT:.0f} s:\n{self.logs()[-3000:]}")

    def reload(self) -> None:
        """Nothing to refresh: the state is read when asked."""

    def kill(self, signal: str | int = "SIGKILL") -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, _signum(signal))
            if _signum(signal) == _signum("SIGKILL"):
                self._process.wait(WORKER_STOP_TIMEOUT)

    def restart(self, timeout: float = WORKER_STOP_TIMEOUT) -> None:
        self.teardown()
        self.start()
        self.ready()

    def teardown(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(WORKER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(WORKER_STOP_TIMEOUT)


def _signum(sig: str | int) -> int:
    return int(getattr(signal, sig)) if isinstance(sig, str) else int(sig)


class CeleryExtSetup(CeleryTestSetup):
    """pytest-celery's setup class for celery-ext: an app it builds itself (when
    ``celery_setup_app`` is not the app under test) gets ``install(app)``."""

    @classmethod
    def update_app_config(cls, app: celery.Celery) -> None:
        install(app)


@pytest.fixture
def celery_setup_cls() -> type[CeleryTestSetup]:
    return CeleryExtSetup


@pytest.fixture
def celery_broker_cluster(celery_ext_server: TestServer) -> Iterator[CeleryBrokerCluster]:
    cluster = CeleryBrokerCluster(CeleryTestBroker(LocalServer(celery_ext_server,
                                                               "celery-ext")))
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_backend_cluster(celery_ext_server: TestServer) -> Iterator[CeleryBackendCluster]:
    cluster = CeleryBackendCluster(CeleryTestBackend(LocalServer(celery_ext_server, "redis")))
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_setup_app(celery_ext_configured_app: Any) -> Any:
    """The app under test, on the broker namespace and backend of this test."""
    return celery_ext_configured_app


@pytest.fixture
def celery_worker_cluster(request: pytest.FixtureRequest, celery_setup_app: Any,
                          celery_ext_namespace: str, celery_ext_worker_options: dict[str, Any],
                          tmp_path: Path) -> Iterator[CeleryWorkerCluster]:
    app_path = str(request.config.getini("celery_ext_app") or "").strip()
    if not app_path:
        raise pytest.UsageError("celery_ext: the worker subprocess imports the app under "
                                "test by its path: set `celery_ext_app = proj.celery:app` "
                                "in your pytest ini")
    conf = celery_setup_app.conf
    worker = LocalWorker(app_path, conf.broker_url, conf.result_backend, celery_ext_namespace,
                         tmp_path / "celery_ext_worker.log",
                         pool=celery_ext_worker_options.get("pool", "prefork"),
                         concurrency=int(celery_ext_worker_options.get("concurrency", 1)))
    worker.start()
    node = CeleryTestWorker(worker, app=celery_setup_app)
    try:
        worker.ready()
        yield CeleryWorkerCluster(node)
    finally:
        worker.teardown()
