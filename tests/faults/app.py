"""The Celery app the chaos workers run (``celery -A tests.faults.app worker``).

One module for both contenders, chosen by environment variables the harness sets:

- ``CELERY_EXT_BROKER_URL``  the broker (``redis://`` = stock, ``celery-ext://`` = ours)
- ``FAULTS_MODE``            ``stock`` or ``ours`` (``ours`` calls ``celery_ext.install``)
- ``CELERY_EXT_NO_INSTALL``  ``1``: ours in drop-in mode (only the URL changed, no
  ``install``), so jobs go to Celery's default ``celery`` queue
- ``FAULTS_ACKS_LATE``       ``0``: the app leaves ``task_acks_late`` and
  ``task_reject_on_worker_lost`` alone (Celery's defaults: acked when a job starts,
  unless ``install`` sets them); otherwise the app sets both (the default)
- ``FAULTS_RECORD``          the append-only file every execution writes to
- ``FAULTS_MASTER_NAME``     the Sentinel master's name, for a sentinel broker URL
  (``sentinel://`` stock, ``celery-ext+sentinel://`` ours)
- ``FAULTS_WAIT_REPLICAS``   ours: the ``wait_replicas`` transport option
- ``FAULTS_CLUSTER``         ``1``: the broker URL is a seed node of a Redis Cluster (ours,
  with the ``cluster`` transport option)
- ``FAULTS_NAMES``           how many job names (each its own job queue with
  ``install``): ``faults.job`` alone by default, else ``faults.job.0`` ... ``.N-1``
- ``FAULTS_QUIET``           ``1``: no log line per job received and succeeded (the
  scale soak's hundreds of thousands of jobs); the pools still log what the harness reads

Every execution appends ``S <job> <pid> <time> <first|again>`` when it starts
(``again``: the message was redelivered, e.g. requeued from a dead pool) and
``D <job> <pid> <time>`` when it is done to ``FAULTS_RECORD``: a record outside the
system under test, so a Redis crash cannot take the evidence with it. A job started
twice as ``first`` was stored twice: a publish retried after its write landed. One
``write`` on an ``O_APPEND`` file is atomic with respect to the other processes' writes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery import Celery

import celery_ext

#: Job name of the one task the harness enqueues (the prefix of several, see job_names).
JOB = "faults.job"


def job_names(n: int) -> list[str]:
    """The job names of an app with ``n`` of them: on a cluster, job queues (one per job
    name) spread over the masters."""
    return [JOB] if n <= 1 else [f"{JOB}.{i}" for i in range(n)]


def make_app(mode: str, broker_url: str, *, install: bool = True,
             acks_late: bool = True, transport_options: dict[str, Any] | None = None,
             names: int = 1) -> Celery:
    """The app for ``mode``: by default stock gets ``acks_late`` and
    ``reject_on_worker_lost`` (its best settings against crashes), ours gets
    ``install()`` (same defaults). ``install=False`` is ours in drop-in mode;
    ``acks_late=False`` leaves both settings to Celery (or ``install``)."""
    app = Celery("faults", broker=broker_url, set_as_current=False)
    if transport_options:
        app.conf.broker_transport_options = transport_options
    if acks_late:
        app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True)
    app.conf.update(
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        worker_send_task_events=False,
        task_send_sent_event=False,
        # Publishes ride out a server restart of a few seconds on a loaded machine
        # (Celery's default policy gives up after about 0.6 s; a restart took 1.6 s in a
        # CI run): what a user sets who wants apply_async to wait for a restarting
        # server. An error that is no lost connection (out of memory) is not retried:
        # the caller is told at once.
        task_publish_retry_policy={"max_retries": 12, "interval_start": 0,
                                   "interval_step": 0.25, "interval_max": 1.0},
    )
    if mode not in ("stock", "ours"):
        raise ValueError(f"FAULTS_MODE must be stock or ours, got {mode!r}")
    for name in job_names(names):
        app.task(name=name, bind=True)(job)
    if mode == "ours" and install:
        celery_ext.install(app)
    return app


def _record(kind: str, job_id: str, *extra: str) -> None:
    path = os.environ["FAULTS_RECORD"]
    line = " ".join((kind, job_id, str(os.getpid()), f"{time.time():.6f}", *extra))
    line += "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def job(task: Any, job_id: str, seconds: float) -> None:
    """A job that takes ``seconds`` and records its start and its end."""
    redelivered = (task.request.delivery_info or {}).get("redelivered")
    _record("S", job_id, "again" if redelivered else "first")
    time.sleep(seconds)
    _record("D", job_id)


if os.environ.get("FAULTS_QUIET") == "1":
    # Celery reads these levels when a worker builds its job strategy and tracer.
    for _name in ("celery.worker.strategy", "celery.app.trace"):
        logging.getLogger(_name).setLevel(logging.WARNING)

if "FAULTS_MODE" in os.environ:
    app = make_app(os.environ["FAULTS_MODE"],
                   os.environ.get("CELERY_EXT_BROKER_URL", "redis://127.0.0.1:6379/0"),
                   install=os.environ.get("CELERY_EXT_NO_INSTALL") != "1",
                   acks_late=os.environ.get("FAULTS_ACKS_LATE") != "0",
                   transport_options={k: v for k, v in (
                       ("master_name", os.environ.get("FAULTS_MASTER_NAME")),
                       ("wait_replicas", int(os.environ.get("FAULTS_WAIT_REPLICAS") or 0)),
                       ("cluster", os.environ.get("FAULTS_CLUSTER") == "1"))
                       if v},
                   names=int(os.environ.get("FAULTS_NAMES") or 1))
