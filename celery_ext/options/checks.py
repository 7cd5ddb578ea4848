"""Every task option of the plugin checked at once, where a bad one must stop things.

A worker checks its tasks when Celery sends ``worker_init``, before it builds its
consumer: Celery's consumer parses each task's ``rate_limit`` as it is made, and an
unparseable one (``"abc"``, ``"10/d"``) would end it in a long traceback before any
consumer step of ours runs. The worker exits instead with one line naming the task,
the option and its value (``bootsteps.check_worker_tasks``).

An ``install(app)`` producer checks a task the first time it publishes it, and again
whenever one of its options changes (:func:`refuse_bad_options`): ``apply_async`` of a
task no worker with the same code starts for raises that same line as ValueError,
instead of leaving a job nobody runs. Other tasks of the app publish as before. A
drop-in producer is a stock Celery app and publishes unchecked.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from celery_ext.config import Settings
from celery_ext.options.backoff import backoff_for
from celery_ext.options.limits import task_limit
from celery_ext.options.rate_limits import task_interval
from celery_ext.options.unique import validate_unique_options
from celery_ext.options.weights import task_weight

#: The task options :func:`check_task` reads; a change of any of them checks it again.
OPTIONS = ("weight", "max_concurrency", "fair_max_concurrency", "rate_limit",
           "fair_rate_limit", "unique_ttl", "unique_key", "stall_after", "backoff", "unique",
           "debounce", "acks_late")


def validate_stall_after(task: Any) -> None:
    """Raise ValueError for a ``stall_after`` option that is not a number of seconds > 0."""
    value = getattr(task, "stall_after", None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or value <= 0):
        raise ValueError(f"celery_ext: task {task.name!r} has stall_after={value!r}; "
                         "it must be a number of seconds > 0 (or None)")


def check_task(task: Any, settings: Settings | None = None) -> None:
    """Raise ValueError, one line naming the task and the value, for the first of its
    options that is not valid."""
    task_weight(task)
    task_limit(task, "max_concurrency")
    task_limit(task, "fair_max_concurrency")
    task_interval(task)
    task_interval(task, "fair_rate_limit")
    validate_unique_options(task)
    validate_stall_after(task)
    backoff_for(task, settings or Settings())


def check_tasks(tasks: Mapping[str, Any], settings: Settings | None = None) -> None:
    """:func:`check_task` for every task, in name order (the first bad one raises)."""
    for _, task in sorted(tasks.items()):
        check_task(task, settings)


def refuse_bad_options(app: Any) -> None:
    """Wrap ``app.send_task`` (which ``apply_async`` and ``delay`` call) so a task with a
    bad option raises ValueError instead of being published. The options are read on
    every call and checked again only when they changed. Idempotent."""
    original = app.send_task
    if getattr(original, "_celery_ext_checks", False):
        return
    checked: dict[str, tuple[Any, ...]] = {}

    @functools.wraps(original)
    def send_task(name: str, *args: Any, **options: Any) -> Any:
        task = options.get("task_type") or app._tasks.get(name)
        if task is not None:
            values = tuple(getattr(task, option, None) for option in OPTIONS)
            if checked.get(name) != values:
                check_task(task)
                checked[name] = values
        return original(name, *args, **options)

    send_task._celery_ext_checks = True  # type: ignore[attr-defined]
    app.send_task = send_task
