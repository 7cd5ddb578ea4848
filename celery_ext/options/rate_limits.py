"""Cluster-wide rate limits: a task's ``rate_limit`` holds across every worker pool.

Celery's own ``rate_limit`` is a token bucket in each worker process: three pools of
``rate_limit="20/s"`` run 60 jobs a second, and each holds prefetched jobs back in
memory while they wait for a token. Here the limit belongs to the job queue, in Redis:
``{ns}:rate_limits`` maps a queue to the interval between two of its jobs (µs), and the
fetch script leaves a queue's jobs in Redis until the next one is due (GCRA on Redis
``TIME``, see ``fetch.lua``), so no slot is held by a job that may not start yet, and
the pool sleeps until that time instead of polling (``readiness.py``).

Where the limits come from: a worker pool, when it starts, writes the limits of the
queues it consumes from its tasks' ``rate_limit`` (Celery's syntax, parsed by
:func:`celery.utils.time.rate`); a consumed queue whose tasks declare none has its
limit removed, so the code stays the source of truth, as with ``max_concurrency``.
``Client.set_rate_limit`` (``celery ext rate-limit``, the dashboard) changes a limit
until the next pool starts. For a task whose limit is enforced here, Celery's
per-process bucket is switched off (:class:`ClusterBuckets`), or both would apply, and
``celery control rate_limit`` changes the limit in Redis.

A limit is a queue's: it is enforced cluster-wide for a queue whose tasks all declare
the same ``rate_limit`` (with ``install(app)`` every task has a queue of its own).
A task that shares its queue with tasks of another limit or none (drop-in, all on the
``celery`` queue) keeps Celery's per-process limit, and the pool says so in one log
line at start: throttling the whole queue would slow the others. Celery's built-in
``celery.*`` tasks are not counted as sharing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery.utils.time import rate

from celery_ext.options.limits import write_limits
from celery_ext.options.routing import any_task_declares, is_builtin, task_queues
from celery_ext.store.keys import Keys

logger = logging.getLogger("celery_ext.options.rate_limits")

#: Units a limit is shown in, largest rate unit first that gives a whole number.
_UNITS = (("s", 1), ("m", 60), ("h", 3600))
#: Longest interval a limit may set (µs): one job a day. ``fetch.lua`` clamps a wait to
#: it too (its ``MAX_WAIT_US``), so a pool never sleeps longer, whatever is stored.
MAX_INTERVAL_US = 86_400_000_000
#: Shortest interval (µs): the unit of the interval, so at most 1,000,000 jobs a second.
MIN_INTERVAL_US = 1
#: The accepted range as a person reads it, for errors and docs.
RANGE_TEXT = "from 1 job a day (e.g. '0.05/h') to 1,000,000/s"


def interval_us(value: Any) -> int | None:
    """Microseconds between two jobs for a Celery rate limit (``"20/s"``, ``"10/m"``,
    ``"5/h"``, a number per second), or None for no limit (None, 0, ``""``).
    Raises ValueError for anything else, and for a rate outside ``RANGE_TEXT``: a
    rarer one overflows the fetch script's integer waits, a more frequent one cannot
    be told apart from one a microsecond."""
    try:
        per_second = rate(value)
    except (TypeError, ValueError, KeyError, ZeroDivisionError):
        raise ValueError(f"{value!r} is not a rate limit like '20/s', '10/m' or '5/h'") from None
    if not per_second:
        return None
    if per_second < 0:
        raise ValueError(f"{value!r} is not a rate limit like '20/s', '10/m' or '5/h'")
    interval = 1_000_000 / per_second
    if not MIN_INTERVAL_US <= interval < MAX_INTERVAL_US + 0.5:
        raise ValueError(f"{value!r} is out of range: a rate limit goes {RANGE_TEXT}")
    return round(interval)


def format_rate(interval: int) -> str:
    """The limit an interval (µs) stands for, as a person writes it: ``"20/s"``."""
    for unit, seconds in _UNITS:
        n = seconds * 1_000_000 / interval
        if n >= 1 and abs(n - round(n)) <= n * 1e-5:
            return f"{round(n)}/{unit}"
    return f"{1_000_000 / interval:.6g}/s"


@dataclass
class RateLimits:
    """What a worker pool's tasks ask for."""

    #: Job queue -> µs between two jobs, enforced by fetch in all pools.
    queues: dict[str, int] = field(default_factory=dict)
    #: Tasks whose limit is one of ``queues`` (Celery's own bucket is off for them).
    tasks: set[str] = field(default_factory=set)
    #: Task -> its queue, for limits left to Celery (the queue is shared).
    local: dict[str, str] = field(default_factory=dict)


def job_rate_limits(app: Any) -> RateLimits:
    """The rate limits of every registered task, by queue (see the module docstring).
    A ``rate_limit`` that is not a rate raises ValueError naming the task."""
    if not any_task_declares(app, "rate_limit", truthy=True):
        return RateLimits()
    queues = task_queues(app)
    by_queue: dict[str, dict[str, int | None]] = {}
    for name, task in sorted(app.tasks.items()):
        value = getattr(task, "rate_limit", None)
        if is_builtin(name) and not value:
            continue
        by_queue.setdefault(queues[name], {})[name] = task_interval(task)
    result = RateLimits()
    for queue, tasks in by_queue.items():
        intervals = set(tasks.values())
        if intervals == {None}:
            continue
        if len(intervals) == 1:
            (result.queues[queue],) = intervals  # type: ignore[assignment]
            result.tasks.update(tasks)
        else:
            result.local.update((name, queue) for name, i in tasks.items() if i is not None)
    return result


def task_interval(task: Any, option: str = "rate_limit") -> int | None:
    """A task's ``rate_limit`` (or another rate ``option``: ``fair_rate_limit``) as µs
    between two jobs (None: no limit); ValueError naming the task, the option and the
    value for one that is not a rate in range."""
    value = getattr(task, option, None)
    try:
        return interval_us(value)
    except ValueError as exc:
        raise ValueError(
            f"celery_ext: task {task.name!r} has {option}={value!r}: {exc}") from None


def write_rate_limits(client: Any, keys: Keys, limits: Mapping[str, int],
                      consumed: Iterable[str]) -> list[str]:
    """Set the rate limits of the consumed queues (removing undeclared ones), starting
    each changed one afresh, and wake pools. Returns the queues whose limit changed."""
    return write_limits(client, keys, limits, consumed, hash_name="rate_limits",
                        reset_name="rate_tat")


def _task_rates(app: Any) -> dict[str, Any]:
    """Each registered task's ``rate_limit`` as it is now."""
    return {name: getattr(task, "rate_limit", None) for name, task in app.tasks.items()}


class ClusterBuckets:
    """A worker's side of the rate limits: Celery's per-process token bucket off for
    the tasks whose limit fetch enforces, and Celery's ``rate_limit`` remote-control
    command (``celery control rate_limit``, Flower's task page) turned into a change of
    the cluster-wide limit.

    Celery's consumer asks ``bucket_for_task`` for each task's bucket in
    ``reset_rate_limits``, which it runs at start and for that command (after setting
    the task's new ``rate_limit``); both are replaced on the consumer. Once the pool is
    connected, :meth:`connected` gives the function that writes limits to Redis, and
    each reset re-reads the tasks' limits and writes the changed ones. A limit the
    command set that is not one (out of range, say) is put back to the task's last
    accepted one before the error goes back to the command's caller: left on the task,
    it would fail every later reset, whichever task that one is for."""

    def __init__(self, consumer: Any, limits: RateLimits) -> None:
        self.limits = limits
        self._write: Callable[[RateLimits], Any] | None = None
        self._accepted = _task_rates(consumer.app)
        bucket_for_task, reset = consumer.bucket_for_task, consumer.reset_rate_limits

        def cluster_bucket_for_task(task: Any) -> Any:
            return None if task.name in self.limits.tasks else bucket_for_task(task)

        def reset_rate_limits() -> None:
            if self._write is not None:
                try:
                    self.limits = job_rate_limits(consumer.app)
                except ValueError:
                    for name, task in consumer.app.tasks.items():
                        if name in self._accepted:
                            task.rate_limit = self._accepted[name]
                    raise
                self._accepted = _task_rates(consumer.app)
            reset()
            if self._write is not None:
                self._write(self.limits)

        consumer.bucket_for_task = cluster_bucket_for_task
        consumer.reset_rate_limits = reset_rate_limits
        reset()
        for name, queue in sorted(limits.local.items()):
            logger.warning("celery_ext: task %r: its rate_limit applies per worker process, as its "
                           "queue %r is shared with tasks of another rate limit or none (route "
                           "it to a queue of its own for a limit across all pools)", name, queue)

    def connected(self, write: Callable[[RateLimits], Any]) -> None:
        """Write the limits now and at every later reset."""
        self._write = write
        write(self.limits)
