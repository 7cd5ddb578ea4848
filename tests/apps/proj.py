"""Celery app used by the end-to-end tests (workers run it as ``-A tests.apps.proj``).

The broker URL comes from ``CELERY_EXT_BROKER_URL`` (and the Sentinel master's name, for a
sentinel URL, from ``CELERY_EXT_MASTER_NAME``); results go to the same server's
db 1 over plain ``redis://``. Tasks record what they do in Redis so tests can count
runs without relying on results. ``CELERY_EXT_NO_INSTALL=1`` runs it drop-in (no
``install(app)``); with it, ``TEST_ACKS_LATE=1`` sets Celery's ``task_acks_late`` and
``task_reject_on_worker_lost`` as a drop-in user who wants them does.
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from celery import Celery

import celery_ext
from tests.apps import record_client

BROKER_URL = os.environ.get("CELERY_EXT_BROKER_URL", "celery-ext://127.0.0.1:6379/0")


def backend_url(broker_url: str, db: int = 1) -> str:
    """The plain redis:// URL of another db on the broker's server."""
    parts = urlsplit(broker_url)
    scheme = "rediss" if parts.scheme in ("rediss", "celery-exts") else "redis"
    return urlunsplit((scheme, parts.netloc, f"/{db}", parts.query, ""))


#: Where results and run records go: the broker's server unless a test routes the
#: broker through a proxy it cuts (the records must not be cut with it).
RECORD_URL = os.environ.get("CELERY_EXT_RECORD_URL", BROKER_URL)

app = Celery("proj", broker=BROKER_URL, backend=backend_url(RECORD_URL))
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_track_started=True,
    result_expires=3600,
)
if os.environ.get("CELERY_EXT_MASTER_NAME"):  # a celery-ext+sentinel:// broker URL
    app.conf.broker_transport_options = {"master_name": os.environ["CELERY_EXT_MASTER_NAME"]}
if os.environ.get("CELERY_EXT_NO_INSTALL") != "1":
    celery_ext.install(app)
elif os.environ.get("TEST_ACKS_LATE") == "1":
    # A drop-in user who wants a running job back when its process dies sets Celery's
    # own options (install(app) defaults them): the job is acked when it ends, and a
    # job whose prefork child died is rejected with requeue.
    app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True)

#: Where tasks leave traces for the tests (``configure`` points it elsewhere).
_record_url = backend_url(RECORD_URL, db=2)


def recorder() -> redis.Redis:
    """Client on the result db, where tasks leave traces for the tests. Room for every
    job of a ``-P gevent -c 200`` worker at once (redis-py's default bound is 100)."""
    return record_client(_record_url, max_connections=1000)


def configure(broker_url: str) -> None:
    """Point this app (in the test process) at a test server's broker URL."""
    global _record_url
    if app.conf.broker_url != broker_url:
        app.conf.broker_url = broker_url
        app.conf.result_backend = backend_url(broker_url)
        app._backend = app._get_backend()  # rebuild with the new URL
        app._pool = None  # connection pools are keyed by URL: a new one is made
        app.amqp._producer_pool = None
    _record_url = backend_url(broker_url, db=2)


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def noop() -> None:
    return None


@app.task(weight=5)
def heavy_weight(i: int) -> int:
    recorder().rpush("order", f"heavy:{i}")
    return i


@app.task(weight=1)
def light_weight(i: int) -> int:
    recorder().rpush("order", f"light:{i}")
    return i


@app.task
def record(key: str, value: Any = 1, sleep: float = 0.0) -> Any:
    """Count one run of ``key``; sleep first if asked (a long job)."""
    if sleep:
        time.sleep(sleep)
    recorder().rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}")
    return value


@app.task(queue="explicit_q")
def explicit(x: int) -> int:
    return x * 10


@app.task(bind=True)
def probe(self: Any, key: str, sleep: float = 0.0) -> Any:
    """Record one run of ``key`` with the job's redelivered flag, and return the flag."""
    if sleep:
        time.sleep(sleep)
    redelivered = self.request.delivery_info.get("redelivered")
    recorder().rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}:{redelivered}")
    return redelivered


@app.task
def fail(key: str) -> None:
    """Count one run of ``key``, then fail."""
    recorder().rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}")
    raise ValueError(f"{key} failed on purpose")


@app.task
def xsum(numbers: list[int]) -> int:
    """Chord body: the sum of its header's results."""
    return sum(numbers)
