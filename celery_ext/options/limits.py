"""Per-job concurrency limits (task option ``max_concurrency=N``).

The fetch script skips a job queue whose in-flight count (``{ns}:running``, all
pools) has reached its limit in ``{ns}:limits``. In-flight means fetched and not
finished, so the limit needs ``acks_late`` (``install(app)``'s default): a job
acked when it starts no longer counts while it runs. A dead pool's share is
released by the reaper when it requeues the pool's jobs, so the count never drifts.

Worker pools write the limits of the job queues they consume from their task
options when they start; the most recently started pool wins. A queue whose tasks
declare no limit has its limit removed, so the code stays the source of truth
(``Client.set_max_concurrency`` changes it until the next pool starts).

A limit is a job queue's, and a task's queue is the one Celery's router sends its jobs
to (``options/routing.py``: its ``queue``, ``task_routes``, the default queue). Every job
of the queue counts against it: a queue shared by tasks of different limits, or with
tasks of none, takes the smallest, so the strictest task's limit holds and the others
share it. The worker says so at start (:func:`shared_limits`), one line per queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kombu.utils.encoding import bytes_to_str

from celery_ext.options.routing import any_task_declares, is_builtin, task_queues
from celery_ext.store.copies import per_copy
from celery_ext.store.keys import Keys

#: Tasks a shared queue's start-up line names before "N more".
SHARED_NAMED = 5


def job_limits(app: Any, option: str = "max_concurrency") -> dict[str, int]:
    """Job queue -> max_concurrency (or another whole-number task ``option``, e.g.
    ``fair_max_concurrency``) for every registered task that declares one, on the queue
    Celery routes it to (tasks sharing a queue: the smallest limit)."""
    if not any_task_declares(app, option):
        return {}
    queues = task_queues(app)
    limits: dict[str, int] = {}
    for name, task in sorted(app.tasks.items()):
        limit = task_limit(task, option)
        if limit is not None:
            queue = queues[name]
            limits[queue] = min(limit, limits.get(queue, limit))
    return limits


def task_limit(task: Any, option: str = "max_concurrency") -> int | None:
    """A task's whole-number limit ``option``, or None; ValueError naming the task for
    anything but a whole number >= 1."""
    limit = getattr(task, option, None)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                              or limit < 1):
        raise ValueError(f"celery_ext: task {task.name!r} has {option}={limit!r}; "
                         "it must be a whole number >= 1 (or None for no limit)")
    return limit


def shared_limits(app: Any, option: str = "max_concurrency") -> list[str]:
    """One line per limited job queue that tasks of another limit or none share (Celery's
    built-in tasks not counted): the queue's limit is the smallest, and every job of
    the queue counts against it."""
    # Only a queue some task declares a limit on can be shared: found first, so a worker
    # of 10,000 job names without limits reads no task's queue and builds no table.
    if not any_task_declares(app, option, builtin=False):
        return []
    queues = task_queues(app)
    limited = {queues[name] for name, task in app.tasks.items()
               if not is_builtin(name) and task_limit(task, option) is not None}
    if not limited:
        return []
    by_queue: dict[str, dict[str, int | None]] = {}
    for name, task in sorted(app.tasks.items()):
        if not is_builtin(name) and queues[name] in limited:
            by_queue.setdefault(queues[name], {})[name] = task_limit(task, option)
    lines = []
    for queue, tasks in sorted(by_queue.items()):
        declared = [v for v in tasks.values() if v is not None]
        if not declared or len(set(tasks.values())) == 1:
            continue
        limit = min(declared)
        others = [f"{name} ({option}={value})" for name, value in tasks.items()
                  if value != limit]
        if len(others) > SHARED_NAMED:
            others[SHARED_NAMED:] = [f"{len(others) - SHARED_NAMED} more"]
        lines.append(f"celery_ext: job queue {queue!r} has {option}={limit} for all its jobs: "
                     f"tasks of another limit or none share it ({', '.join(others)}); route "
                     "a task to a queue of its own for a limit of its own")
    return lines


def write_limits(client: Any, keys: Keys, limits: Mapping[str, int],
                 consumed: Iterable[str], hash_name: str = "limits",
                 reset_name: str | None = None, suffix: str = "") -> list[str]:
    """Set the limits of the consumed queues (removing undeclared ones) and wake
    pools that may have been waiting on a queue whose limit changed. ``hash_name``:
    the Keys attribute of another hash of limits than ``limits`` (``rate_limits``);
    ``reset_name``: of a hash whose field of each changed queue is deleted with it (a
    rate limit's state); ``suffix``: after the queue name in its field (``"\n"``: the
    per-key limit of a fair queue). Each queue's limit is written in its own copy (on
    a cluster, ``Keys.of``: fetch reads it there).

    Only the changes are written and published (one read first): a pool consuming
    1,000 job queues would otherwise send 2,000 commands at every start and wake
    every idle pool 1,000 times. Returns the queues whose limit changed."""
    consumed = set(consumed) | set(limits)
    if not consumed:
        return []
    groups = keys.groups(sorted(consumed))
    parts = list(groups)
    current: dict[str, str] = {}
    for copy, (found,) in zip(parts, per_copy(
            client, parts, lambda p, c: p.hgetall(getattr(c, hash_name))), strict=True):
        fields = {queue + suffix: queue for queue in groups[copy]}
        current.update((fields[bytes_to_str(k)], bytes_to_str(v)) for k, v in found.items()
                       if bytes_to_str(k) in fields)
    changed = [queue for queue in sorted(consumed)
               if current.get(queue) != (str(limits[queue]) if queue in limits else None)]
    if not changed:
        return []
    with client.pipeline() as pipe:
        for queue in changed:
            copy = keys.of(queue)
            if queue in limits:
                pipe.hset(getattr(copy, hash_name), queue + suffix, limits[queue])
            else:
                pipe.hdel(getattr(copy, hash_name), queue + suffix)
            if reset_name:
                pipe.hdel(getattr(copy, reset_name), queue)
            if not keys.cluster:
                pipe.publish(keys.wake_channel, queue)
        pipe.execute()
    if keys.cluster:  # a cluster's pipeline cannot carry a PUBLISH
        for queue in changed:
            client.publish(keys.wake_channel, queue)
    return changed
