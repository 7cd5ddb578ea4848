"""Celery app for the result backend's end-to-end tests (``-A tests.apps.proj_results``).

The broker is ``CELERY_EXT_BROKER_URL`` (a one-node test server); results go to
``CELERY_EXT_RESULT_URL`` through the plugin's backend (``celery-ext://...``), on a cluster
when ``CELERY_EXT_RESULT_CLUSTER=1``, in the namespace ``CELERY_EXT_RESULT_NAMESPACE``
(behind Sentinel, the master's name is ``CELERY_EXT_RESULT_MASTER_NAME``). Tasks
record their runs on ``CELERY_EXT_RECORD_URL`` (plain ``redis://``), so a test counts runs
without trusting the backend it tests.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import redis
from celery import Celery, signals
from celery._state import get_current_task

import celery_ext
from tests.apps import record_client

BROKER_URL = os.environ.get("CELERY_EXT_BROKER_URL", "celery-ext://127.0.0.1:6379/0")
RESULT_URL = os.environ.get("CELERY_EXT_RESULT_URL", "celery-ext://127.0.0.1:6379/1")
RECORD_URL = os.environ.get("CELERY_EXT_RECORD_URL", "redis://127.0.0.1:6379/2")


def result_options(cluster: bool, namespace: str) -> dict[str, Any]:
    options: dict[str, Any] = {"cluster": cluster, "namespace": namespace}
    if os.environ.get("CELERY_EXT_RESULT_MASTER_NAME"):  # a celery-ext+sentinel:// URL
        options["master_name"] = os.environ["CELERY_EXT_RESULT_MASTER_NAME"]
    return options


app = Celery("proj_results", broker=BROKER_URL, backend=RESULT_URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_track_started=True,
    result_extended=True,
    # CELERY_EXT_TEST_NO_EXPIRES=1: result_expires unset (the backend still sets a TTL).
    result_expires=None if os.environ.get("CELERY_EXT_TEST_NO_EXPIRES") == "1" else 3600,
    result_backend_transport_options=result_options(
        os.environ.get("CELERY_EXT_RESULT_CLUSTER") == "1",
        os.environ.get("CELERY_EXT_RESULT_NAMESPACE", "celery_ext")),
)
celery_ext.install(app)


def configure(broker_url: str, result_url: str, record_url: str, cluster: bool = False,
              namespace: str = "celery_ext", **options: Any) -> None:
    """Point this (test process's) app at the test servers; ``options`` are more result
    backend transport options (``master_name``)."""
    global RECORD_URL
    app.conf.broker_url = broker_url
    app.conf.result_backend = result_url
    app.conf.result_backend_transport_options = {**result_options(cluster, namespace),
                                                 **options}
    app._backend = app._get_backend()  # Celery keeps one backend per thread: this one's
    app._pool = None
    app.amqp._producer_pool = None
    RECORD_URL = record_url


def recorder() -> redis.Redis:
    return record_client(RECORD_URL)


def _hold(key: str) -> None:
    """Wait (at most a minute) while the test keeps ``key``: a job held mid-run."""
    deadline = time.monotonic() + 60
    while key and recorder().exists(key) and time.monotonic() < deadline:
        time.sleep(0.02)


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def fail(message: str) -> None:
    raise ValueError(message)


@app.task(bind=True)
def progress(self: Any, hold: str) -> str:
    """Reports a custom PROGRESS state, then waits while ``hold`` exists."""
    self.update_state(state="PROGRESS", meta={"done": 1, "of": 2})
    _hold(hold)
    return "finished"


@app.task(bind=True)
def part(self: Any, i: int, hold: str = "") -> int:
    """A chord's header job: counts its runs, waits while ``hold`` exists."""
    recorder().incr(f"part_runs:{i}")
    _hold(hold)
    return i


@app.task(bind=True)
def total(self: Any, values: list[int]) -> int:
    """A chord's body: counts its calls (by the chord's id) and sums its header."""
    recorder().incr(f"body_calls:{self.request.group or 'none'}")
    recorder().incr("body_calls")
    return sum(values)


@app.task
def on_error(request: Any, exc: Exception, traceback: Any) -> None:
    """An error callback: records which job failed and why."""
    recorder().rpush("errors", f"{request.id} {type(exc).__name__}: {exc}")


@app.task(bind=True)
def part_then_die(self: Any, i: int) -> int:
    """A chord's header job whose first run kills its whole worker pool right after its
    result was stored and counted, before the ack (see ``_die_after_first_run``)."""
    recorder().incr(f"part_runs:{i}")
    return i


@signals.task_postrun.connect
def _die_after_first_run(sender: Any = None, task_id: str = "", **kwargs: Any) -> None:
    # task_postrun comes after the result was stored and the chord counted it: the pool
    # dies before the ack, so the job runs again on another pool.
    if getattr(sender, "name", None) != part_then_die.name:
        return
    i = kwargs["args"][0]
    if recorder().incr(f"postrun:{i}") == 1:
        os.killpg(os.getpgid(0), signal.SIGKILL)


@app.task(bind=True)
def part_dies_after_body(self: Any, i: int) -> int:
    """A chord's (only) header job whose first run kills its whole worker pool right after it
    published the chord's body, before the chord was marked done (see
    ``_die_after_body_publish``)."""
    recorder().incr(f"part_runs:{i}")
    return i


@signals.after_task_publish.connect
def _die_after_body_publish(sender: Any = None, **kwargs: Any) -> None:
    # The body went out from on_chord_part_return, which chord_done.lua follows: a pool
    # killed here leaves the chord claimed and not settled, so the header job runs again
    # and publishes the body again.
    task = get_current_task()
    if task is None or task.name != part_dies_after_body.name:
        return
    if recorder().incr(f"body_published:{task.request.id}") == 1:
        os.killpg(os.getpgid(0), signal.SIGKILL)


@app.task
def kill_pool(i: int) -> None:
    """Kills its whole worker pool on every run: a poison pill once it was recovered more
    than ``max_recoveries`` times."""
    recorder().incr(f"kill_runs:{i}")
    os.killpg(os.getpgid(0), signal.SIGKILL)
