"""The Celery apps ``python -m bench.result_latency`` runs, one per side.

A worker runs ``make_app`` on ``BENCH_BROKER_URL`` and ``BENCH_RESULT_BACKEND`` (Celery's
``redis://`` or ours, ``celery-ext://``) and, when ``BENCH_STAMPS`` names a file, appends one
line per job there: the job's id and the worker's monotonic clock (one clock with the
client's on Linux) when the job started, when the backend's store began and ended, and
when Celery finished with it. The client process builds both sides' apps with ``make_app``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun

import celery_ext

TASK = "bench.result_latency_app.noop"
#: job id -> [started, store began, store ended] in this worker process.
_STAMPS: dict[str, list[float]] = {}


def make_app(broker: str | None, backend: str | None) -> Celery:
    app = Celery("bench_result_latency", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                    result_expires=3600)
    celery_ext.install(app)
    app.task(name=TASK)(noop)
    return app


def noop() -> None:
    """The job: nothing, so the round trip is all there is to time."""
    return None


app = make_app(os.environ.get("BENCH_BROKER_URL"), os.environ.get("BENCH_RESULT_BACKEND"))


def _timed_store(store: Callable[..., Any]) -> Callable[..., Any]:
    def timed(task_id: str, *args: Any, **kwargs: Any) -> Any:
        stamps = _STAMPS.get(task_id)
        if stamps is not None:
            stamps.append(time.monotonic())
        try:
            return store(task_id, *args, **kwargs)
        finally:
            if stamps is not None:
                stamps.append(time.monotonic())
    return timed


@task_prerun.connect
def _started(task_id: str, task: Any, **kwargs: Any) -> None:
    if not os.environ.get("BENCH_STAMPS"):
        return
    backend = task.backend
    if not getattr(backend, "_bench_timed", False):  # this process's backend, wrapped once
        backend._store_result = _timed_store(backend._store_result)
        backend._bench_timed = True
    _STAMPS[task_id] = [time.monotonic()]


@task_postrun.connect
def _finished(task_id: str, **kwargs: Any) -> None:
    path = os.environ.get("BENCH_STAMPS")
    stamps = _STAMPS.pop(task_id, None)
    if not path or stamps is None or len(stamps) != 3:
        return
    line = " ".join([task_id, *(f"{s:.6f}" for s in (*stamps, time.monotonic()))]) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
