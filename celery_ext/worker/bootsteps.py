"""Celery worker integration: bootsteps and the worker signals the plugin listens to.

The worker pool itself (heartbeat, reaper, requeuer, what the process holds of its
in-flight record) is owned by :class:`celery_ext.worker.worker_pool.WorkerPool`, which the
transport makes for any worker consuming through our scheme. This module adds what
needs Celery's worker objects, in every mode unless said otherwise:

- ``JobQueues`` (``install(app)`` only: it is routing): consume every task's queue;
- ``worker_init``: every task option checked (``options/checks.py``: weight, limits,
  rate_limit, unique, stall_after, backoff) before Celery builds its consumer, which
  parses each ``rate_limit`` itself; a bad one stops the worker with one line;
- ``Sets``: the same check for a task bound since, and the concurrency and rate limits
  written (Celery's per-process rate limit is off for the tasks whose limit holds in
  all pools), with one line per queue shared by tasks of different limits;
- ``DeadLetters``: unknown and invalid messages go to the dead set;
- ``QuietStrategies`` (``install(app)`` only): every task's strategy and tracer built
  with the garbage collector paused (``strategy.py``);
- ``PeriodicJobs``: the app's ``beat_schedule`` handed to the worker pool's periodic leader;
- ``celery inspect scheduled`` answered from the scheduled and retry sets in Redis
  (``inspect_scheduled.py``);
- ``worker_ready``: the pool's registration details (node, concurrency, pool type,
  queues) and the job queues' weights;
- ``worker_shutting_down`` / ``worker_shutdown``: the pool says "stopping", then stops.

Drop-in mode (the broker URL is ours, no ``install(app)``): ``celeryd_init`` adds the
consumer steps, the Request class that counts lost workers and sends failed jobs to
the dead set, and ``task.checkin()``.

Celery's embedded test worker (``celery.contrib.testing.worker.start_worker``, which
``celery.contrib.pytest`` and Django test cases use) is a plain ``WorkController``: it
sends ``worker_init``, ``test_worker_started`` and ``test_worker_stopped`` but none of
``celeryd_init``, ``worker_ready`` or ``worker_shutting_down``. ``worker_init`` adds the
same worker parts, ``test_worker_started`` registers the pool as ``worker_ready`` does,
and ``test_worker_stopped`` stops it as ``worker_shutdown`` does, so a test worker keeps
every promise a ``celery worker`` process keeps and leaves nothing running.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import redis
from celery import bootsteps
from celery.contrib.testing.worker import test_worker_started, test_worker_stopped
from celery.signals import (
    celeryd_init,
    worker_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from kombu import Queue
from kombu.asynchronous import get_event_loop

from celery_ext.config import ConfigError, Settings, check_broker_url, uses_our_transport
from celery_ext.options.backoff import apply_backoffs
from celery_ext.options.checks import check_tasks
from celery_ext.options.fair import (
    job_fair_limits,
    job_fair_rates,
    write_fair_limits,
    write_fair_rates,
)
from celery_ext.options.limits import job_limits, shared_limits, write_limits
from celery_ext.options.rate_limits import ClusterBuckets, job_rate_limits, write_rate_limits
from celery_ext.options.routing import task_queue, task_queues
from celery_ext.options.weights import all_weights, set_weights, task_weight
from celery_ext.store.connections import (
    CLUSTER_NO_WAIT,
    cluster_config,
    green_sockets,
    sentinel_config,
)
from celery_ext.store.dead_set import wrap_consumer_handlers
from celery_ext.store.keys import Keys
from celery_ext.worker import worker_pool as _pool
from celery_ext.worker.green import cooperative_retry_sleep, share_result_backend
from celery_ext.worker.strategy import build_without_collector

logger = logging.getLogger("celery_ext.worker.bootsteps")

#: Celery's own Request class; drop-in mode replaces it (only it) with ours.
CELERY_DEFAULT_REQUEST = "celery.worker.request:Request"
#: Executors refused at start with one line. Eventlet's monkey-patching is not one our
#: clients and threads are run under (gevent's is: the supported green executor).
UNSUPPORTED_EXECUTORS = ("eventlet",)


def job_queues(app: Any, finalize: bool = True, strict: bool = True) -> dict[str, int]:
    """Job queue name -> weight for every registered task, on the queue Celery's router
    sends its jobs to (``options/routing.py``; tasks sharing a queue: the largest weight).

    A weight that is not a whole number >= 1 raises ValueError naming the task, or
    counts as 1 with ``strict=False`` (producers: only workers use weights, and a
    worker refuses to start with one)."""
    queues = task_queues(app, finalize=finalize)
    result: dict[str, int] = {}
    for name, task in sorted(app.tasks.items()):
        try:
            weight = task_weight(task) or 1
        except ValueError:
            if strict:
                raise
            weight = 1
        queue = queues[name]
        result[queue] = max(result.get(queue, 1), weight)
    return result


def declare_job_queues(app: Any, weights: Mapping[str, int] | None = None) -> None:
    """Make every job queue known to ``app.amqp.queues`` in every process (so that
    ``celery purge``, ``-X`` and inspection see them); consuming them is decided in
    the worker (:class:`JobQueues`). ``weights``: :func:`job_queues`' answer, when the
    caller has it (a pass over every task less at a worker's start)."""
    queues = app.amqp.queues
    if weights is None:
        weights = job_queues(app, finalize=False, strict=False)
    for name in weights:
        if name not in queues:
            queues.add(Queue(name, routing_key=name))


class JobQueues(bootsteps.Step):
    """Make a worker consume the job queue of every registered task.

    A worker started with ``-Q`` consumes only the queues it was given (their
    weights still apply); ``-X`` exclusions are honoured by Celery itself, since every
    job queue is declared when the app is finalized. A worker that consumes every job
    queue also consumes the queue of a task bound after it started (:class:`NewTasks`).
    """

    name = "celery_ext.JobQueues"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        app = worker.app
        try:
            weights = job_queues(app)
        except ValueError as exc:  # a bad weight= stops the worker with one line
            raise SystemExit(str(exc)) from None
        set_weights(weights)
        declare_job_queues(app, weights)
        queues = app.amqp.queues
        if getattr(queues, "_consume_from", None) is None:  # no -Q/-X: consume them all
            worker._celery_ext_every_job_queue = True
            for name in weights:
                if name not in queues.consume_from:
                    queues.select_add(queues[name])
        if not uses_our_transport(app.conf):
            logger.warning(
                "celery_ext: install(app) is active but the broker is not celery-ext:// "
                "(jobs are routed per task name, without crash-safe ownership)")


class NewTasks(bootsteps.StartStopStep):
    """Consumer step: a task bound to the app while this worker runs (a test defining
    one beside an embedded worker) is learnt, and its job queue consumed when the
    worker consumes every job queue (``install(app)``, no ``-Q``), as Celery's
    ``add_consumer`` remote control would; stock Celery needs ``worker.reload()``."""

    name = "celery_ext.NewTasks"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        _running_consumers.add(c)

    def stop(self, c: Any) -> None:
        _running_consumers.discard(c)

    shutdown = stop


#: Consumers of this process that run (:class:`NewTasks`).
_running_consumers: weakref.WeakSet[Any] = weakref.WeakSet()


def task_bound(task: Any, app: Any) -> None:
    """``Task.on_bound`` of every task of an app with the worker parts: Celery calls it
    when it binds a task. Only a task bound while a consumer of its app runs matters:
    the others (every task of an app, when it is finalized) leave at once, without
    iterating the weak set (20,000 binds at a start with 10,000 job names)."""
    if not _running_consumers:
        return
    for consumer in list(_running_consumers):
        if consumer.app is not app:
            continue
        queue = task_queue(app, task)
        every = getattr(consumer.controller, "_celery_ext_every_job_queue", False)
        if every:
            try:
                set_weights({queue: job_queues(app, finalize=False).get(queue, 1)})
            except ValueError:
                continue  # a bad weight= is refused when a worker starts
            declare_job_queues(app)
        hub = getattr(consumer.controller, "hub", None)
        if hub is not None:  # the consumer's own thread, between two turns of its loop
            hub.call_soon(_learn, consumer, queue if every else None)
        else:
            _learn(consumer, queue if every else None)


def _learn(consumer: Any, queue: str | None) -> None:
    consumer.update_strategies()
    if queue is not None:
        consumer.add_task_queue(queue)


@worker_ready.connect(weak=False)
def describe_pool(sender: Any = None, **kwargs: Any) -> None:
    """The worker consumes: add what only Celery knows to its pool's registration
    (node name, concurrency, pool type; its channel records the job queues it consumes)
    and publish the queues' weights."""
    c = sender
    channel = getattr(getattr(c, "connection", None), "default_channel", None)
    if channel is None or not hasattr(channel, "worker_pool"):
        return  # not our transport
    pool = channel.worker_pool
    controller = getattr(c, "controller", None)
    executor_cls = getattr(controller, "pool_cls", None)
    consumed = c.app.amqp.queues.consume_from
    pool.describe_consumed()  # the consumers are up: the registration below carries them
    pool.describe(
        node=c.hostname,
        concurrency=getattr(controller, "concurrency", "") or "",
        pool_type=getattr(executor_cls, "__module__", str(executor_cls)).rsplit(".", 1)[-1],
        started_at=int(time.time() * 1000),
        state="running",
    )
    if pool.keys.cluster and consumed:
        # The registry is how the reaper and requeuer find every queue's copy.
        with contextlib.suppress(redis.exceptions.OutOfMemoryError):
            pool.client.sadd(pool.keys.queues, *consumed)
    weights: dict[Any, Any] = {q: w for q, w in all_weights().items() if q in consumed}
    if weights:
        try:
            pool.client.hset(pool.keys.weights, mapping=weights)
        except redis.exceptions.OutOfMemoryError:
            # Only the dashboard reads them; the pool must start and drain a full Redis.
            logger.warning("celery_ext: Redis is at maxmemory: job queue weights not "
                           "published for the dashboard (the pool runs with them)")


def validate_settings(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
    """``celeryd_init``: check celery_ext settings before the worker connects, and exit
    with one clear line instead of a traceback from deep inside Kombu."""
    app = getattr(instance, "app", None)
    if app is None:
        return
    conf = app.conf
    urls = [u for u in (conf.broker_url, conf.broker_read_url, conf.broker_write_url)
            if isinstance(u, str) and u]
    ours = uses_our_transport(conf)
    if not ours and not getattr(app, "_celery_ext_installed", False):
        return
    try:
        for url in urls:  # a typo'd scheme or port: one line, not Kombu's traceback
            check_broker_url(url, conf.broker_transport)
        Settings.load(conf.broker_transport_options)
        sentinel_config(urls, conf.broker_transport_options)  # master_name is there
        cluster = cluster_config(urls, conf.broker_transport_options)  # db 0, no sentinel
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    if ours and cluster is not None and Settings.load(conf.broker_transport_options).wait_replicas:
        raise SystemExit(CLUSTER_NO_WAIT)
    if ours:
        # ``celery worker -P x`` hands its choice over as "pool" (the class); a
        # WorkController made in code may name it "pool_cls".
        options = kwargs.get("options") or {}
        executor = _executor_name(
            options.get("pool") or options.get("pool_cls") or conf.worker_pool)
        if executor in UNSUPPORTED_EXECUTORS:
            raise SystemExit(f"celery_ext: the {executor} pool is not supported; use gevent "
                             "for green threads (-P gevent), or prefork, threads or solo")
        cooperative_retry_sleep()
        if executor == "gevent":
            share_result_backend(app)
        add_worker_parts(app)
    _one_line_connection_errors()


def _executor_name(executor: Any) -> str:
    """The name of Celery's execution pool (``-P``) from its option or class."""
    if isinstance(executor, str):
        return executor.rsplit(".", 1)[-1].split(":")[0].lower()
    return str(getattr(executor, "__module__", "")).rsplit(".", 1)[-1]


def add_worker_parts(app: Any) -> None:
    """What a worker of ``app`` needs from the plugin whether or not ``install(app)``
    ran: the consumer steps, the Request class (lost-worker counting, failed jobs to
    the dead set, promoted jobs' eta ignored), ``task.checkin()``, ``task.cursor`` and the hook that
    makes a running worker learn a task bound after it started. Idempotent."""
    from celery_ext.worker import control
    from celery_ext.worker.cursor import task_cursor
    from celery_ext.worker.inspect_scheduled import register as register_inspect_scheduled
    from celery_ext.worker.observer import _task_checkin

    control.register()
    register_inspect_scheduled()
    app.steps["consumer"].add(Sets)
    app.steps["consumer"].add(DeadLetters)
    app.steps["consumer"].add(RevokedEvents)
    app.steps["consumer"].add(PeriodicJobs)
    app.steps["consumer"].add(NewTasks)
    app.steps["consumer"].add(QuietStrategies)
    if "on_bound" not in vars(app.Task):
        app.Task.on_bound = classmethod(task_bound)
    if app.Task.Request in (CELERY_DEFAULT_REQUEST, None):
        app.Task.Request = "celery_ext.worker.request:Request"
    if not hasattr(app.Task, "checkin"):
        app.Task.checkin = _task_checkin
    if not hasattr(app.Task, "cursor"):
        app.Task.cursor = property(task_cursor)


def _one_line_connection_errors() -> None:
    """Celery logs each failed connection attempt as "Cannot connect to <url>: <error>."
    and "Trying again in N seconds..." on a second line; make it one line per attempt
    (the URL is masked by Celery either way)."""
    from celery.worker.consumer import consumer

    if consumer.CONNECTION_ERROR.count("\n") > 1:
        consumer.CONNECTION_ERROR = "consumer: Cannot connect to %s: %s. %s"


celeryd_init.connect(validate_settings, weak=False)


@worker_init.connect(weak=False)
def _on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    """Every ``WorkController``, the embedded test worker's included: the worker parts
    of drop-in mode (``celeryd_init`` added them already in a ``celery worker`` process;
    adding them is idempotent), after every task option is checked: Celery sends it after
    importing the task modules and before building the consumer."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    if uses_our_transport(app.conf) or getattr(app, "_celery_ext_installed", False):
        check_worker_tasks(app)
    if uses_our_transport(app.conf):
        add_worker_parts(app)


def check_worker_tasks(app: Any) -> None:
    """Exit with one line for the first registered task with a bad option, before Celery
    builds the consumer (which parses every ``rate_limit`` and would end in a long
    traceback at an unparseable one; see ``options/checks.py``)."""
    try:
        app.finalize(auto=True)
        check_tasks(app.tasks, Settings.load(app.conf.broker_transport_options))
    except (ConfigError, ValueError) as exc:
        raise SystemExit(str(exc)) from None


@test_worker_started.connect(weak=False)
def _on_test_worker_started(sender: Any = None, consumer: Any = None, **kwargs: Any) -> None:
    """The embedded test worker consumes (it sends no ``worker_ready``): register its
    pool's node, concurrency and queues."""
    if consumer is not None:
        describe_pool(sender=consumer)


@test_worker_stopped.connect(weak=False)
def _on_test_worker_stopped(**kwargs: Any) -> None:
    """The embedded test worker stopped (it sends no ``worker_shutting_down``): the pool
    says "stopping", returns what it holds, deregisters and joins its threads."""
    _pool.mark_all_stopping()
    _on_shutdown()


@worker_shutting_down.connect(weak=False)
def _on_shutting_down(**kwargs: Any) -> None:
    """Celery runs this inside its SIGTERM/SIGQUIT handler, in the event loop's thread,
    wherever that thread was interrupted (perhaps holding a lock the pool or redis-py
    would take): the work is done in a short-lived thread of its own. Under gevent the
    handler runs in gevent's own loop, where starting a thread would wait (and raise
    ``BlockingSwitchOutError``): there the work is a greenlet, spawned without waiting."""
    global _stopping
    if _stopping is None:  # a second signal (warm, then cold) finds it started
        if green_sockets():
            import gevent

            _stopping = gevent.spawn(begin_stopping)
            return
        thread = threading.Thread(target=begin_stopping, name="celery_ext-stopping",
                                  daemon=True)
        thread.start()
        _stopping = thread


class _Joinable(Protocol):
    def join(self, timeout: float | None = None) -> Any: ...


#: The thread (greenlet under gevent) ``_on_shutting_down`` started; the pools stop only
#: after it is done, so its "stopping" is never written over a pool that has already
#: deregistered.
_stopping: _Joinable | None = None
#: How long the worker's shutdown waits for that thread (seconds). Its one write takes
#: milliseconds; against an unreachable Redis the shutdown goes on without it.
STOPPING_JOIN_TIMEOUT = 10.0


def begin_stopping() -> None:
    """The worker is shutting down: the pools say "stopping" (checkins answer stop), then
    the event loop is woken to read its shutdown flag.

    Celery's signal handler only sets that flag; the loop reads it between turns. An idle
    pool of ours sends no fetch (its WAKE listener and ready refresh take over), so the
    loop's poll sleeps until its next timer: up to a second with Kombu's timers, where
    stock's blocking BRPOP returns sooner. Called from the loop's own thread, Kombu's
    ``call_soon`` would not wake the poll; called from this one, it does."""
    _pool.mark_all_stopping()
    hub = get_event_loop()
    if hub is not None:
        hub.call_soon(_nothing)
    else:
        # No event loop (Celery's synloop, under gevent): the loop reads its flag when
        # ``drain_events(timeout=2.0)`` returns, and Kombu's drain_events polls again
        # until its timeout even when woken; our polls return at once from now on.
        _pool.stop_polls()


def _nothing() -> None:
    """The callback whose only effect is to end the event loop's poll (``begin_stopping``)."""


@worker_shutdown.connect(weak=False)
def _on_shutdown(**kwargs: Any) -> None:
    global _stopping
    stopping, _stopping = _stopping, None
    if stopping is not None:
        stopping.join(STOPPING_JOIN_TIMEOUT)
    _pool.stop_all()


class Sets(bootsteps.StartStopStep):
    """Consumer step: the job options of the scheduled, retry and dead sets (backoff,
    unique, max_concurrency, stall_after), checked when the worker is built so a bad
    option stops it with a clear message, and the concurrency limits written once
    the consumer is connected. (The requeuer belongs to the worker pool.) It also
    tells the channel the worker's concurrency (``Channel.fetch_min``)."""

    name = "celery_ext.Sets"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        app = c.app
        try:
            settings = Settings.load(app.conf.broker_transport_options)
            check_tasks(app.tasks, settings)  # a task bound since worker_init
            self.limits = job_limits(app)
            self.fair_limits = job_fair_limits(app)
            self.fair_rates = job_fair_rates(app)
            rate_limits = job_rate_limits(app)
            apply_backoffs(app.tasks, settings)
        except (ConfigError, ValueError) as exc:
            raise SystemExit(str(exc)) from None
        for line in [*shared_limits(app), *shared_limits(app, "fair_max_concurrency")]:
            logger.warning("%s", line)
        #: None: this pool leaves rate limits to Celery (not our transport) or has them
        #: off (``worker_disable_rate_limits``), and writes none.
        self.buckets: ClusterBuckets | None = None
        if uses_our_transport(app.conf) and not getattr(c, "disable_rate_limits", False):
            self.buckets = ClusterBuckets(c, rate_limits)
        self.written = False

    def start(self, c: Any) -> None:
        channel = c.connection.default_channel
        if hasattr(channel, "fetch_min"):  # fetch in batches of the pool's size
            channel.fetch_min = max(1, int(getattr(c.controller, "concurrency", 1) or 1))
        if self.written or not hasattr(channel, "worker_pool"):
            return  # already written by this worker, or not our transport
        pool = channel.worker_pool
        keys, consumed = Keys.for_settings(pool.settings), c.app.amqp.queues.consume_from
        write_limits(pool.client, keys, self.limits, consumed)
        write_fair_limits(pool.client, keys, self.fair_limits, consumed)
        write_fair_rates(pool.client, keys, self.fair_rates, consumed)
        if self.buckets is not None:
            self.buckets.connected(lambda limits: write_rate_limits(
                pool.client, keys, limits.queues, consumed))
        self.written = True


class DeadLetters(bootsteps.Step):
    """Consumer step: unknown task names and undecodable or invalid messages go to
    the dead set with their reason instead of being logged and dropped."""

    name = "celery_ext.DeadLetters"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        if not getattr(c, "_celery_ext_dead_letters", False):
            wrap_consumer_handlers(c)
            c._celery_ext_dead_letters = True


class QuietStrategies(bootsteps.Step):
    """Consumer step (``install(app)`` only, as the shared Request classes are): Celery
    builds every task's strategy and tracer (``Consumer.update_strategies``) with the
    garbage collector paused, most of that build's cost at 10,000 job names
    (``strategy.build_without_collector``)."""

    name = "celery_ext.QuietStrategies"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        if getattr(c.app, "_celery_ext_installed", False):
            build_without_collector(c)


class RevokedEvents(bootsteps.Step):
    """Consumer step: the jobs the fetch drops as revoked are announced with Celery's
    ``task-revoked`` event from this consumer, as Celery announces a revoked job it
    receives (``worker/control.mark_revoked``): Flower shows them revoked."""

    name = "celery_ext.RevokedEvents"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        from celery_ext.worker import control

        control.watch(c)


class PeriodicJobs(bootsteps.StartStopStep):
    """Consumer step: the worker pool runs the app's ``beat_schedule`` and the runtime
    entries (the pool holding the periodic lease enqueues each due run; see
    ``periodic_leader.py``)."""

    name = "celery_ext.PeriodicJobs"
    requires = ("celery.worker.consumer.tasks:Tasks",)  # after the connection step

    def start(self, c: Any) -> None:
        channel = c.connection.default_channel
        if hasattr(channel, "worker_pool"):  # our transport
            channel.worker_pool.run_periodic(c.app)
