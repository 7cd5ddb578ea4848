"""Celery app for the dashboard, CLI, widget and Flower tests (``-A tests.apps.proj_web``).

Broker from ``CELERY_EXT_BROKER_URL``; results on db 1 of the same server.
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery import Celery

import celery_ext


def backend_url(broker_url: str, db: int = 1) -> str:
    """The plain redis:// URL of another db on the broker's server."""
    parts = urlsplit(broker_url)
    scheme = "rediss" if parts.scheme in ("rediss", "celery-exts") else "redis"
    return urlunsplit((scheme, parts.netloc, f"/{db}", parts.query, ""))


BROKER_URL = os.environ.get("CELERY_EXT_BROKER_URL", "celery-ext://127.0.0.1:6379/0")

app = Celery("proj_web", broker=BROKER_URL, backend=backend_url(BROKER_URL))
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_track_started=True,
    worker_send_task_events=True,
    task_send_sent_event=True,
    result_expires=3600,
)
celery_ext.install(app)


def configure(broker_url: str) -> None:
    """Point this app (in the test process) at a test server's broker URL."""
    if app.conf.broker_url != broker_url:
        app.conf.broker_url = broker_url
        app.conf.result_backend = backend_url(broker_url)
        app._backend = app._get_backend()
        app._pool = None
        app.amqp._producer_pool = None


@app.task(unique="until_finished", unique_key=lambda key: key, acks_late=True)
def locked(key: str) -> str:
    """A unique job locked until it finishes (the job widget shows its lock)."""
    return key


@app.task
def echo(value: Any) -> Any:
    """A short job that returns its argument."""
    return value


@app.task(bind=True)
def progress(self: Any, steps: int = 5, step_seconds: float = 0.3) -> dict[str, Any]:
    """A long job that checks in after every step and stops when told to."""
    for step in range(1, steps + 1):
        time.sleep(step_seconds)
        if self.checkin(message=f"step {step}/{steps}", progress=step / steps):
            return {"stopped_at": step}
    return {"steps": steps}


def _flag(key: str) -> bool:
    import redis

    return bool(redis.Redis.from_url(backend_url(app.conf.broker_url, db=2)).exists(key))


@app.task
def fragile(key: str, note: Any = None) -> str:
    """Fails (not retried: it lands in the dead set) until Redis key ``key`` exists on db 2."""
    if _flag(key):
        return f"ok {key}"
    raise RuntimeError(f"{key} is not ready: {note!r}")


@app.task(bind=True, max_retries=3)
def flaky(self: Any, key: str, countdown: float = 60.0) -> str:
    """Fails until Redis key ``key`` exists on db 2; retries after ``countdown``."""
    if _flag(key):
        return "ok"
    raise self.retry(exc=RuntimeError(f"{key} not ready"), countdown=countdown)


@app.task(bind=True)
def keeps_cursor(self: Any, key: str, cursor: Any) -> str:
    """A resumable job: checks in with ``cursor``, then waits until Redis key ``key``
    exists on db 2 (checking in, so a status read meanwhile sees it running)."""
    self.checkin(message="waiting", cursor=cursor)
    deadline = time.monotonic() + 60
    while not _flag(key) and time.monotonic() < deadline:
        time.sleep(0.1)
    return "done"
