"""The Celery app ``python -m bench.result_backend`` runs: the broker is ``celery-ext://`` on the
bench's server; the result backend is ``BENCH_RESULT_BACKEND`` (Celery's ``redis://`` or
ours, ``celery-ext://``, on another db of the same server)."""

from __future__ import annotations

import os

from celery import Celery

import celery_ext

app = Celery("bench_result_backend", broker=os.environ.get("BENCH_BROKER_URL"),
             backend=os.environ.get("BENCH_RESULT_BACKEND"))
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                result_expires=3600)
celery_ext.install(app)


@app.task(name="bench.result_backend_app.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="bench.result_backend_app.total")
def total(values: list[int]) -> int:
    return sum(values)
