"""Celery worker bootsteps added by ``install(app)``."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from celery import bootsteps
from celery.signals import celeryd_init, worker_shutdown, worker_shutting_down
from kombu import Queue

from .config import ConfigError, Settings, check_broker_url
from .dead import wrap_consumer_handlers
from .heartbeater import Heartbeater, all_heartbeaters, current_pool_id
from .keys import Keys
from .limits import job_limits, write_limits
from .memory import eviction_warning
from .reaper import Reaper
from .requeuer import Requeuer
from .retry import apply_backoffs
from .unique import validate_unique_options
from .weights import all_weights, set_weights

logger = logging.getLogger("celery_ext.bootsteps")

_reapers: list[Reaper] = []
_requeuers: list[Requeuer] = []
#: The broker's memory policy is checked once per worker process (not per reconnect).
_memory_checked: list[bool] = []


def job_queues(app: Any, finalize: bool = True, strict: bool = True) -> dict[str, int]:
    """Job queue name -> weight for every registered task (explicit ``queue=`` kept).

    A weight that is not a whole number >= 1 raises ValueError naming the task, or
    counts as 1 with ``strict=False`` (producers: only workers use weights, and a
    worker refuses to start with one)."""
    if finalize:
        app.finalize(auto=True)
    result: dict[str, int] = {}
    for name, task in sorted(app.tasks.items()):
        queue = getattr(task, "queue", None) or name
        weight = getattr(task, "weight", None)
        if weight is not None:
            if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
                if not strict:
                    weight = 1
                else:
                    raise ValueError(
                        f"celery_ext: task {name!r} has weight={weight!r}; "
                        "weight must be a whole number >= 1")
        result[queue] = max(result.get(queue, 1), weight or 1)
    return result


def declare_job_queues(app: Any) -> None:
    """Make every job queue known to ``app.amqp.queues`` in every process (so that
    ``celery purge``, ``-X`` and inspection see them); consuming them is decided in
    the worker (:class:`JobQueues`)."""
    queues = app.amqp.queues
    for name in job_queues(app, finalize=False, strict=False):
        if name not in queues:
            queues.add(Queue(name, routing_key=name))


class JobQueues(bootsteps.Step):
    """Make a worker consume the job queue of every registered task.

    A worker started with ``-Q`` consumes only the queues it was given (their
    weights still apply); ``-X`` exclusions are honoured by Celery itself, since every
    job queue is declared when the app is finalized.
    """

    name = "celery_ext.JobQueues"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        # Fix the pool id before the prefork pool forks, so children know their owner.
        current_pool_id()
        app = worker.app
        try:
            weights = job_queues(app)
        except ValueError as exc:  # a bad weight= stops the worker with one line
            raise SystemExit(str(exc)) from None
        set_weights(weights)
        declare_job_queues(app)
        queues = app.amqp.queues
        if getattr(queues, "_consume_from", None) is None:  # no -Q/-X: consume them all
            for name in weights:
                if name not in queues.consume_from:
                    queues.select_add(queues[name])
        if not str(app.conf.broker_url or "").startswith(("celery-ext", "celery-exts")) \
                and "celery_ext" not in str(app.conf.broker_transport or ""):
            logger.warning(
                "celery_ext: install(app) is active but the broker is not celery-ext:// "
                "(jobs are routed per task name, without crash-safe ownership)")


class WorkerPool(bootsteps.StartStopStep):
    """Registers the worker pool with its details and runs the reaper.

    The transport registers the pool and starts its heartbeat at the first fetch;
    this step adds node name, concurrency, pool type and job names, and runs one
    reaper per pool. Shutdown marks the pool "stopping" (checkin returns True) and,
    once everything has stopped, deregisters it.
    """

    name = "celery_ext.WorkerPool"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        channel = c.connection.default_channel
        if not hasattr(channel, "_ensure_pool"):
            return  # not our transport
        hb: Heartbeater = channel._ensure_pool()
        controller = getattr(c, "controller", None)
        pool_cls = getattr(controller, "pool_cls", None)
        hb.update_info(
            node=c.hostname,
            concurrency=getattr(controller, "concurrency", "") or "",
            pool_type=getattr(pool_cls, "__module__", str(pool_cls)).rsplit(".", 1)[-1],
            queues=",".join(sorted(c.app.amqp.queues.consume_from)),
            started_at=int(time.time() * 1000),
            state="running",
        )
        weights: dict[Any, Any] = {
            q: w for q, w in all_weights().items() if q in c.app.amqp.queues.consume_from}
        if weights:
            try:
                hb.client.hset(hb.keys.weights, mapping=weights)
            except redis.exceptions.OutOfMemoryError:
                # Only the dashboard reads them; the pool must start and drain a full Redis.
                logger.warning("celery_ext: Redis is at maxmemory: job queue weights not "
                               "published for the dashboard (the pool runs with them)")
        if not _memory_checked:
            _memory_checked.append(True)
            try:
                warning = eviction_warning(hb.client)
            except Exception as exc:  # INFO refused (ACL): not worth stopping for
                logger.debug("celery_ext: could not read the broker's memory policy: %s", exc)
            else:
                if warning:
                    logger.warning(warning)
        if not _reapers:
            reaper = Reaper(channel._new_sync_client(), channel.settings, own_pool_id=hb.pool_id)
            _reapers.append(reaper)
            reaper.start()


def validate_settings(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
    """``celeryd_init``: check celery_ext settings before the worker connects, and exit
    with one clear line instead of a traceback from deep inside Kombu."""
    app = getattr(instance, "app", None)
    if app is None:
        return
    conf = app.conf
    urls = [u for u in (conf.broker_url, conf.broker_read_url, conf.broker_write_url)
            if isinstance(u, str) and u]
    ours = any(u.startswith(("celery-ext:", "celery-exts:")) for u in urls)
    if not ours and not getattr(app, "_celery_ext_installed", False):
        return
    try:
        for url in urls:  # a typo'd scheme or port: one line, not Kombu's traceback
            check_broker_url(url, conf.broker_transport)
        Settings.load(conf.broker_transport_options)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    _one_line_connection_errors()


def _one_line_connection_errors() -> None:
    """Celery logs each failed connection attempt as "Cannot connect to <url>: <error>."
    and "Trying again in N seconds..." on a second line; make it one line per attempt
    (the URL is masked by Celery either way)."""
    from celery.worker.consumer import consumer

    if consumer.CONNECTION_ERROR.count("\n") > 1:
        consumer.CONNECTION_ERROR = "consumer: Cannot connect to %s: %s. %s"


celeryd_init.connect(validate_settings, weak=False)


@worker_shutting_down.connect(weak=False)
def _on_shutting_down(**kwargs: Any) -> None:
    for hb in all_heartbeaters():
        try:
            hb.client.hset(hb.keys.pool(hb.pool_id), "state", "stopping")
        except Exception as exc:
            logger.warning("celery_ext: could not mark pool stopping: %s", exc)


@worker_shutdown.connect(weak=False)
def _on_shutdown(**kwargs: Any) -> None:
    while _reapers:
        _reapers.pop().stop()
    for hb in all_heartbeaters():
        hb.stop(deregister=True)


def validate_stall_after(task: Any) -> None:
    """Raise ValueError for a ``stall_after`` option that is not a number of seconds > 0."""
    value = getattr(task, "stall_after", None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or value <= 0):
        raise ValueError(f"celery_ext: task {task.name!r} has stall_after={value!r}; "
                         "it must be a number of seconds > 0 (or None)")


class Sets(bootsteps.StartStopStep):
    """Consumer step, per pool: the requeuer (scheduled/retry promotion) and the job
    options of the scheduled, retry and dead sets (backoff, unique, max_concurrency),
    checked when the worker is built so a bad option stops it with a clear message.

    It starts once the consumer is connected (Celery retries the connection), and
    runs until the worker shuts down: the requeuer rides out connection losses."""

    name = "celery_ext.Sets"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        app = c.app
        try:
            settings = Settings.load(app.conf.broker_transport_options)
            self.limits = job_limits(app)
            for task in app.tasks.values():
                validate_unique_options(task)
                validate_stall_after(task)
            apply_backoffs(app.tasks, settings)
        except (ConfigError, ValueError) as exc:
            raise SystemExit(str(exc)) from None

    def start(self, c: Any) -> None:
        channel = c.connection.default_channel
        if _requeuers or not hasattr(channel, "settings"):
            return  # already running, or not our transport
        client, settings = channel._new_sync_client(), channel.settings
        write_limits(client, Keys(settings.namespace), self.limits,
                     c.app.amqp.queues.consume_from)
        requeuer = Requeuer(client, settings)
        _requeuers.append(requeuer)
        requeuer.start()


@worker_shutdown.connect(weak=False)
def _stop_requeuers(**kwargs: Any) -> None:
    while _requeuers:
        _requeuers.pop().stop()


class DeadLetters(bootsteps.Step):
    """Consumer step: unknown task names and undecodable or invalid messages go to
    the dead set with their reason instead of being logged and dropped."""

    name = "celery_ext.DeadLetters"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        if not getattr(c, "_celery_ext_dead_letters", False):
            wrap_consumer_handlers(c)
            c._celery_ext_dead_letters = True
