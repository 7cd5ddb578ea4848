"""``install(app)``: the one line that turns a Celery app into a celery_ext app."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery
from celery.app.amqp import AMQP as CeleryAMQP
from kombu.connection import maybe_channel
from kombu.utils.objects import cached_property

from celery_ext.options.checks import refuse_bad_options
from celery_ext.options.unique import patch_send_task
from celery_ext.producer.bulk import batch_groups, task_apply_many
from celery_ext.producer.publish import Producer, Producers
from celery_ext.worker.bootsteps import JobQueues, add_worker_parts, declare_job_queues

logger = logging.getLogger("celery_ext")

#: Celery's own task strategy; install() replaces it (only it) with celery_ext.worker.strategy.
CELERY_DEFAULT_STRATEGY = "celery.worker.strategy:default"

#: Celery settings install() changes unless the user set them: a job is acked when
#: it *finishes* (so it stays in its pool's in-flight record while running), a job
#: whose prefork child died is returned to its queue instead of dropped, and a result
#: backend on a Redis out of reach retries its write until Redis is back: when it
#: gives up, Celery's tracer raises out of the job, which a threads, gevent or solo
#: pool never reports (the job is neither acked nor failed, its result PENDING). Its
#: first wait is 0.5 s, not 10 ms: Celery logs each retry with its traceback, and an
#: outage of a few seconds should cost a few of them, not ten.
DEFAULTS: dict[str, Any] = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "result_backend_always_retry": True,
    "result_backend_base_sleep_between_retries_ms": 500,
}


def route_by_task_name(name: str, args: Any, kwargs: Any, options: Mapping[str, Any],
                       task: Any = None, **kw: Any) -> dict[str, Any]:
    """Celery router: every task goes to the job queue named after it.

    Routers run after an explicit ``queue=`` (on the task or the call), which wins,
    and after every router the user configured (this one is appended last).
    """
    return {"queue": name}


def _append_router(conf: Any) -> None:
    routes = conf.task_routes
    if routes is None:
        new: list[Any] = [route_by_task_name]
    elif isinstance(routes, Sequence) and not isinstance(routes, str):
        if route_by_task_name in routes:
            return
        new = [*routes, route_by_task_name]
    else:
        new = [routes, route_by_task_name]
    conf.task_routes = new


class AMQP(CeleryAMQP):
    """Celery's AMQP API whose queue table includes every job queue in every
    process (``celery purge``, ``inspect``), not only in workers."""

    @cached_property
    def queues(self) -> Any:
        queues = self.Queues(self.app.conf.task_queues)
        self.__dict__["queues"] = queues  # declare_job_queues reads it back
        if self.app.finalized:
            declare_job_queues(self.app)
        elif self.app.autofinalize:
            self.app.finalize(auto=True)  # its on_after_finalize hook declares them
        return queues

    @property
    def producer_pool(self) -> Any:
        """Celery's producer pool, of :class:`celery_ext.producer.Producer` (which skips
        Kombu's per-publish declaration round) on a connection pool of its own with the
        same limit: its producers keep their connection between uses
        (:class:`celery_ext.producer.publish.Producers`), so they must not hold connections
        of Kombu's process-wide pool, which other apps on the same URL share. Celery
        resets it after a fork. Its connections know the app (``Producers.celery_app``):
        Celery's revoke broadcast goes through this pool, and the channel marks the
        results of the jobs the revoke removes in the app's backend."""
        pool = self.__dict__.get("_producer_pool")  # (Celery's attribute, None after a fork)
        if pool is None:
            limit = self.app.pool.limit
            pool = self.__dict__["_producer_pool"] = Producers(
                self.app.connection_for_write().Pool(limit=limit), limit=limit,
                Producer=Producer)
            pool.celery_app = self.app
        return pool

    publisher_pool = producer_pool

    def TaskConsumer(self, channel: Any, queues: Any = None, accept: Any = None,
                     **kw: Any) -> Any:
        """Celery's task consumer, with every queue declared in one round trip on our
        transport (Kombu declares them one by one: 2-3 s for 1,000 job queues)."""
        queues = queues or list(self.queues.consume_from.values())
        chan = maybe_channel(channel)
        predeclared = getattr(chan, "predeclared", None)
        if predeclared is None or kw.get("auto_declare") is False:
            return super().TaskConsumer(channel, queues=queues, accept=accept, **kw)
        with predeclared(queues):
            return super().TaskConsumer(channel, queues=queues, accept=accept, **kw)


def install(app: Celery, *, route_by_name: bool = True) -> Celery:
    """Make ``app`` use one job queue per task name, consumed by every worker.

    - routes each task to the job queue named after it (explicit ``queue=`` wins);
    - workers started without ``-Q`` consume every registered task's job queue, with
      the task option ``weight=N`` (default 1) as that queue's weight;
    - defaults ``task_acks_late`` and ``task_reject_on_worker_lost`` to True unless
      configured, so a job is owned by its worker pool until it finishes;
    - adds busy-worker records, ``task.checkin()``, and per-job recovery counting
      when a prefork child dies (poison pills end in the dead set); drop-in mode
      gets these too (see ``bootsteps.add_worker_parts``), and the worker pool's
      heartbeat, reaper and requeuer come with the transport in either mode;
    - keeps countdown/eta jobs and retries in Redis (scheduled and retry sets) and
      failed, expired, unknown and undecodable jobs in the dead set; adds the task
      options ``unique``, ``max_concurrency`` and ``backoff`` (see docs/sets.md);
    - publishes a group's jobs in bulk, and adds ``task.apply_many(args_list)``
      (see docs/bulk.md).

    Returns ``app`` so it can be used inline. Safe to call more than once.
    """
    if getattr(app, "_celery_ext_installed", False):
        return app
    app._celery_ext_installed = True
    app.add_defaults(dict(DEFAULTS))

    if route_by_name:
        if app.configured:
            _append_router(app.conf)
        else:
            def _on_configure(sender: Any = None, source: Any = None, **kw: Any) -> None:
                _append_router(app.conf if source is None else source)

            app.on_after_configure.connect(_on_configure, weak=False)
    if app.finalized:
        declare_job_queues(app)
    else:
        app.on_after_finalize.connect(lambda sender=None, **kw: declare_job_queues(app),
                                      weak=False)
    if "amqp" not in app.__dict__:
        app.amqp_cls = f"{__name__}:AMQP"
    app.steps["worker"].add(JobQueues)
    patch_send_task(app)
    refuse_bad_options(app)  # outside the unique wrapper: a bad task takes no lock
    # Every task of the app gets the counting Request class and a checkin() method
    # (as in drop-in mode), and the consumer steps of the sets and the dead set.
    app.Task.Request = "celery_ext.worker.request:Request"
    # Groups publish in bulk, and tasks have apply_many (producer/bulk.py).
    app.Task.apply_many = task_apply_many
    batch_groups()
    add_worker_parts(app)
    # ...and tasks with the same settings share one Request class (1,000 job names, 1 class).
    if app.Task.Strategy == CELERY_DEFAULT_STRATEGY:
        app.Task.Strategy = "celery_ext.worker.strategy:default"
    return app
