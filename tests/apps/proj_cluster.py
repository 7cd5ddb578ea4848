"""Celery app for the end-to-end tests on a Redis Cluster (``-A tests.apps.proj_cluster``).

The broker is the cluster (``CELERY_EXT_BROKER_URL``, a seed node, with the transport
option ``cluster``); a cluster has no db 1, so there is no result backend, and tasks
record what they do on a one-node server of the tests (``CELERY_EXT_RECORD_URL``,
plain ``redis://``). ``CELERY_EXT_NO_INSTALL=1`` runs it drop-in (only the URL and
the option: no ``install(app)``). Thirty job names (``job0`` ... ``job29``) have their
own job queues, which spread over the masters.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

import celery_ext
from tests.apps import record_client

BROKER_URL = os.environ.get("CELERY_EXT_BROKER_URL", "celery-ext://127.0.0.1:7000/0")
RECORD_URL = os.environ.get("CELERY_EXT_RECORD_URL", "redis://127.0.0.1:6379/3")
NAMES = 30

app = Celery("proj_cluster", broker=BROKER_URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={"cluster": True,
                              "namespace": os.environ.get("CELERY_EXT_NAMESPACE", "celery_ext")},
    worker_hijack_root_logger=False,
    task_ignore_result=True,
)
if os.environ.get("TEST_PERIODIC") == "1":  # run by the pools (worker/periodic_leader.py)
    app.conf.beat_schedule = {"tick": {"task": "tests.apps.proj_cluster.tick", "schedule": 1.0}}
if os.environ.get("CELERY_EXT_NO_INSTALL") != "1":
    celery_ext.install(app)


def configure(broker_url: str, namespace: str, record_url: str) -> None:
    """Point this (test process's) app at a cluster, a namespace and a record server."""
    global RECORD_URL
    app.conf.broker_url = broker_url
    app.conf.broker_transport_options = {"cluster": True, "namespace": namespace}
    RECORD_URL = record_url


def recorder() -> redis.Redis:
    return record_client(RECORD_URL)


def _run(name: str, i: int, sleep: float, hold: str = "") -> None:
    if sleep:
        time.sleep(sleep)
    deadline = time.monotonic() + 60
    while hold and recorder().exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)  # held until the test deletes the key
    pipe = recorder().pipeline(transaction=False)
    pipe.incr(f"runs:{name}:{i}")
    pipe.incr("done")
    pipe.execute()


def _job(n: int) -> None:
    name = f"job{n}"

    def run(i: int, sleep: float = 0.0, hold: str = "") -> None:
        _run(name, i, sleep, hold)

    run.__name__ = run.__qualname__ = name
    app.task(name=f"tests.apps.proj_cluster.{name}")(run)


for _n in range(NAMES):
    _job(_n)


@app.task(name="tests.apps.proj_cluster.later")
def later(i: int) -> None:
    _run("later", i, 0.0)


@app.task(name="tests.apps.proj_cluster.flaky", bind=True, max_retries=1)
def flaky(self, i: int) -> None:  # type: ignore[no-untyped-def]
    """Fails its first run, then succeeds (a retry through the retry set)."""
    if recorder().incr(f"flaky:{i}") == 1:
        raise self.retry(countdown=0.5)
    _run("flaky", i, 0.0)


@app.task(name="tests.apps.proj_cluster.unique", unique=True)
def unique(i: int) -> None:
    """A unique job (one pending per arguments): its lock is in its queue's copy."""
    _run("unique", i, 0.0)


@app.task(name="tests.apps.proj_cluster.tick", bind=True)
def tick(self) -> None:  # type: ignore[no-untyped-def]
    """A periodic job's run: its id is its due time's, so a second run of one due
    time shows as more runs than ids."""
    pipe = recorder().pipeline(transaction=False)
    pipe.sadd("tick_ids", self.request.id)
    pipe.incr("tick_runs")
    pipe.execute()


@app.task(name="tests.apps.proj_cluster.boom")
def boom(i: int) -> None:
    raise ValueError(f"boom {i}")
