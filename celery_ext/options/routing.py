"""Which job queue a task's jobs go to: the one answer every queue-bound option and a
worker's consumed queues share.

Celery decides a job's queue in ``send_task`` by asking ``app.amqp.router``: an explicit
``queue=`` (on the task or the call) wins, then the app's ``task_routes`` in order (a
dict, glob patterns, router functions; ``install(app)`` appends its by-name router
last), then ``task_default_queue``. :func:`task_queue` asks the same router the same
way, once per task, so a limit (``max_concurrency``, ``fair_max_concurrency``, a
``rate_limit``), a ``weight`` and the queues a worker started without ``-Q`` consumes
all land on the queue the jobs are actually in: a task routed to ``reports`` is
limited, weighted and consumed as ``reports``; a drop-in task without routes is on
``celery``.

What cannot be known before a job is sent, and the rule for it:

- A router function is asked with the task's name and no arguments (``args=()``,
  ``kwargs={}``); a router that routes by argument values, or raises without them, is
  taken at that answer (a raise falls back to the task's own ``queue`` or the default
  queue). Jobs it sends elsewhere land on a queue whose options are those of the tasks
  routed there without arguments.
- A ``queue=`` given on one call (``apply_async(queue="x")``) is the job's queue for
  that job only: the job counts against ``x``'s limits and weight (those of the tasks
  routed to ``x``), not its task's, and a worker consumes ``x`` only if a task routes
  there or ``-Q`` names it. Limits belong to job queues; route the task (``queue=`` on
  the task, ``task_routes``) for its limit to hold on every job.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.options.routing")

#: Prefix of Celery's built-in tasks (``celery.chord_unlock`` ...): they share the default
#: queue without taking part in the options of the tasks there.
BUILTIN_PREFIX = "celery."
#: Whether a router raised without arguments: said once per process, for the first of
#: the app's own tasks (a router that reads its arguments raises for every task).
_warned = False
#: The app's attribute keeping what :func:`task_queues` answered: (the router and the
#: default queue the answers came from, task name -> (task, its own ``queue``, job
#: queue)). A worker asks for every task's queue nine times at start (weights, limits,
#: shared-limit lines, rate limits, fair limits, declared queues); with 10,000 job names
#: each time was 10,000 calls of Celery's router, seconds of a start. An answer is kept
#: while the task object, its own queue, the router (Celery builds it once per app, from
#: ``task_routes`` at first use) and the default queue stay the same. (On the app, so
#: it goes with the app.)
ANSWERS_ATTR = "_celery_ext_task_queues"


def task_queue(app: Any, task: Any) -> str:
    """The job queue ``task``'s jobs go to when sent without per-call options, as
    Celery's router decides it (see the module docstring)."""
    own = getattr(task, "queue", None)
    options = {"queue": own} if own else {}
    try:
        route = app.amqp.router.route(options, task.name, (), {}, task)
    except Exception as exc:
        global _warned
        queue = own or app.conf.task_default_queue
        if not _warned and not is_builtin(task.name):
            _warned = True
            logger.warning("celery_ext: task_routes raised %s for task %s without arguments; "
                           "its options and consumed queue are those of %s (and so for any "
                           "other task it raises for)", type(exc).__name__,
                           one_line(task.name), one_line(str(queue)))
        return str(getattr(queue, "name", queue))
    queue = route.get("queue") or app.conf.task_default_queue
    return str(getattr(queue, "name", queue))


def task_queues(app: Any, finalize: bool = True) -> dict[str, str]:
    """Task name -> its job queue (:func:`task_queue`), for every registered task."""
    if finalize:
        app.finalize(auto=True)
    router = app.amqp.router
    basis = (router, tuple(map(id, getattr(router, "routes", ()))),
             app.conf.task_default_queue)
    kept: tuple[tuple[Any, ...], dict[str, tuple[Any, Any, str]]] | None = getattr(
        app, ANSWERS_ATTR, None)
    if kept is None or kept[0] != basis:
        kept = (basis, {})
        setattr(app, ANSWERS_ATTR, kept)
    known = kept[1]
    result: dict[str, str] = {}
    for name, task in sorted(app.tasks.items()):
        own = getattr(task, "queue", None)
        answer = known.get(name)
        if answer is None or answer[0] is not task or answer[1] != own:
            answer = known[name] = (task, own, task_queue(app, task))
        result[name] = answer[2]
    return result


def any_task_declares(app: Any, option: str, *, truthy: bool = False,
                      builtin: bool = True) -> bool:
    """Whether some registered task sets ``option``: to anything but None, or with
    ``truthy`` to a true value (a rate limit of None, 0 or "" is none); Celery's built-in
    tasks counted unless ``builtin=False``. An option's pass over every task asks this
    first and reads no task's queue (:func:`task_queues`, a pass of its own) when no task
    sets it: with 10,000 job names and no limits a worker's start made six such passes
    for nothing (issue 36). Every value that is set still goes through the full pass,
    so a bad one is refused as before."""
    for name, task in app.tasks.items():
        value = getattr(task, option, None)
        if (bool(value) if truthy else value is not None) and (builtin or not is_builtin(name)):
            return True
    return False


def is_builtin(name: str) -> bool:
    """Whether ``name`` is one of Celery's built-in tasks."""
    return name.startswith(BUILTIN_PREFIX)
