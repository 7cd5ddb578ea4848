"""Helpers shared by the end-to-end tests: waiting, reading what the jobs recorded and
what Redis holds, running the ``celery`` command, and the two ways of using the plugin
(``install(app)`` or drop-in) as a fixture."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from tests.workers import REPO_ROOT, WorkerProcess

T = TypeVar("T")
#: Keys of the default namespace, which the test apps use.
K = Keys("celery_ext")
#: The ``worker_factory`` fixture: builds a :class:`WorkerProcess` (call ``.start()``).
Factory = Callable[..., WorkerProcess]


def wait_for(cond: Callable[[], T], timeout: float, what: str, step: float = 0.05) -> T:
    """Poll ``cond`` until it returns something truthy (returned); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


def recorded(rec: redis.Redis, kind: str, key: str) -> list[str]:
    """What the test apps' tasks pushed to ``<kind>:<key>`` (``runs``, ``start``)."""
    return [v.decode() for v in rec.lrange(f"{kind}:{key}", 0, -1)]


def start_workers(factory: Factory, n: int, app: str = "tests.apps.proj_sets",
                  **kw: Any) -> list[WorkerProcess]:
    """Start ``n`` pools of ``app`` at once (startup dominates these tests) and wait for
    all of them to be ready."""
    workers = [factory(app, **kw) for _ in range(n)]
    for w in workers:
        w.start(wait_ready=False)
    for w in workers:
        assert w.ready_pattern
        w.wait_for_log(w.ready_pattern, timeout=60)
    return workers


def message(tag: str, queue: str, retries: int = 0) -> dict[str, Any]:
    """A minimal kombu message as ``Channel._put`` sees it."""
    return {"body": "", "content-type": "application/json", "content-encoding": "utf-8",
            "headers": {"task": queue, "id": f"id-{tag}", "retries": retries},
            "properties": {"delivery_tag": tag, "body_encoding": "base64",
                           "delivery_info": {"exchange": "", "routing_key": queue}}}


# -- the two ways of using the plugin --------------------------------------------------------

#: ``install``: ``celery_ext.install(app)``. ``dropin``: only the broker URL is ours.
MODES = ("install", "dropin")


class Mode:
    """How a test's producer and workers use the plugin.

    ``install``: workers run the test app with ``install(app)``; the test app itself
    sends, so each job goes to the job queue named after its task. ``dropin``: workers
    run the test app with ``CELERY_EXT_NO_INSTALL=1``; a stock Celery app on the same
    broker and result backend sends, so jobs go to Celery's default ``celery`` queue,
    which a worker started without ``-Q`` consumes.
    """

    def __init__(self, name: str, broker_url: str) -> None:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r}")
        from tests.apps import proj

        proj.configure(broker_url)
        self.name = name
        self.app: Celery = proj.app if name == "install" else Celery(
            "dropin-sender", broker=broker_url, backend=proj.backend_url(broker_url),
            set_as_current=False)

    @property
    def dropin(self) -> bool:
        return self.name == "dropin"

    def env(self, *, acks_late: bool = False, **more: str) -> dict[str, str]:
        """A worker's environment in this mode, plus ``more``.

        ``acks_late=True``: the drop-in app sets Celery's own ``task_acks_late`` and
        ``task_reject_on_worker_lost`` (``install(app)`` defaults both), as a drop-in
        user does who wants a running job back when its process dies."""
        env = {"CELERY_EXT_NO_INSTALL": "1"} if self.dropin else {}
        if self.dropin and acks_late:
            env["TEST_ACKS_LATE"] = "1"
        return {**env, **more}

    def send(self, task: Any, *args: Any, **options: Any) -> AsyncResult:
        """Enqueue ``task(*args)`` as a producer of this mode does."""
        if self.dropin:
            return self.app.send_task(task.name, args=args, **options)
        return task.apply_async(args, **options)

    def queue(self, task: Any) -> str:
        """The job queue a job of ``task`` sent by :meth:`send` waits in."""
        if self.dropin:
            return str(self.app.conf.task_default_queue)
        return str(getattr(task, "queue", None) or task.name)

    def close(self) -> None:
        if self.dropin:
            self.app.close()

    def __repr__(self) -> str:
        return f"<Mode {self.name}>"


@pytest.fixture(name="mode", params=MODES)
def mode_fixture(request: pytest.FixtureRequest, broker_url: str,
                 redis_client: redis.Redis) -> Iterator[Mode]:
    """Runs a test once per mode (import it into the test module as ``mode_fixture``);
    the server is flushed first (``redis_client``) and the test app configured."""
    mode = Mode(request.param, broker_url)
    yield mode
    mode.close()


# -- Redis, the celery command, the network -------------------------------------------
def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def node_name(worker: WorkerProcess) -> str:
    return worker.hostname.replace("%h", socket.gethostname())


def inflight(client: redis.Redis, pool_id: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """A pool's in-flight record: delivery tag -> (queue, message)."""
    out = {}
    for tag, rec in client.hgetall(K.inflight(pool_id)).items():
        queue, payload = rec.decode().split("\n", 1)
        out[tag.decode()] = (queue, json.loads(payload))
    return out


def only_pool(client: redis.Redis, timeout: float = 10) -> str:
    """The id of the one registered worker pool."""
    pools = wait_for(lambda: client.zrange(K.pools, 0, -1), timeout, "a registered pool")
    assert len(pools) == 1, pools
    return str(pools[0].decode())


def celery_cli(*args: str, broker_url: str, env: dict[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m celery ...`` like a user would, against ``broker_url``."""
    full_env = {**os.environ, "CELERY_EXT_BROKER_URL": broker_url,
                "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "celery", *args], cwd=REPO_ROOT,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def push(client: redis.Redis, queue: str, payload: bytes | str) -> None:
    """Enqueue a raw payload as a producer does (the ``enqueue`` script: push, ready
    set, wake-up)."""
    Scripts(client)("enqueue", [K.queue(queue), K.ready, K.queues],
                    [payload, queue, K.wake_channel, 0])


def run_bench(*args: str, timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    """``python -m <args>`` (a bench harness) from the repository root; an overrun is
    terminated, not killed (the bench stops the servers and workers it started) and
    fails the test naming ``what``."""
    argv = [sys.executable, "-m", *args]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{what} ran over {timeout:g} s: {err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
