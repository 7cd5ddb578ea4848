"""Unique jobs: enqueuing is a no-op while an identical job is pending.

Task options::

    @app.task(unique=True)                          # same name + same args = identical
    @app.task(unique=True, unique_key=lambda user_id, **kw: str(user_id))
    @app.task(unique=True, unique_ttl=600)          # lock safety net, seconds
    @app.task(unique="until_finished")              # locked through retries and the run
    @app.task(unique=True, unique_key=..., debounce=1.0)  # latest arguments, 1 s after the last

``install(app)`` wraps ``app.send_task`` (which ``apply_async`` and ``delay`` call):
for a unique task it computes the key, and the producer (``producer.Enqueuer``)
enqueues (or schedules) the job with one script that checks and takes the lock
``{ns}:unique:<name>:<sha1>`` atomically. If the lock is held, nothing is pushed
and the caller's ``AsyncResult`` carries the id of the job already pending.

Two modes say how long the lock lives (see docs/sets.md, "Unique jobs"):

* ``until_started`` (``unique=True``): the lock is released when a worker *starts*
  the job (the Request's ``on_accepted``): from then on an identical job may be
  enqueued again, because the running one may already have read the state it would
  act on. It is also released when the job expires. Retries are always published
  (they are the same job) and take the lock again if it is free.
* ``until_finished``: the lock is held from the enqueue through the run and every
  retry, and released by the script of the job's final move: the ``ack`` of its last
  run, its move to the dead set (a poison pill's too, in ``recover``), or its deletion
  from a set. Its value is the task id
  and the delivery tag of the message holding it (:func:`lock_value`): a retry is a
  new message under the same task id, which takes the lock over when it is published
  (before the old message is acked), so the old message's ack leaves it alone. A job
  returned to its queue (the reaper's recovery of a dead pool, a requeue) keeps its
  tag and so its lock: it runs again. The mode needs ``acks_late`` (the default under
  ``install(app)``): acked at start, the ack would be the final move.

The TTL (``unique_ttl`` option, default ``Settings.unique_ttl``, counted from the
job's due time, and for ``until_finished`` renewed when the job starts) is the safety
net for a lock whose job never reaches its release (a purged queue, a crash between
two scripts). Deleting a scheduled, retry or
dead job through ``celery_ext.client`` releases its lock in the same script
(:func:`lock_of` reads it from the stored message).

``debounce`` (seconds, with either mode): the job waits in the scheduled set until
``debounce`` seconds after the latest enqueue with its key. An enqueue that finds the
holder still there replaces it, in one script, by the new job (its arguments, its
task id) due ``debounce`` seconds from now: one job runs, with the latest arguments.
Once the holder left the scheduled set, the mode decides as for any unique job.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from celery_ext.store.compact import headers_of
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.options.unique")

#: Message header carrying the lock's digest, so the worker can release it.
HEADER = "celery_ext_unique"
#: Message header of a job locked until finished (value :data:`UNTIL_FINISHED`).
MODE_HEADER = "celery_ext_unique_mode"
UNTIL_STARTED = "until_started"
UNTIL_FINISHED = "until_finished"
#: The values of the ``unique`` task option, and the mode each one means.
MODES = {True: UNTIL_STARTED, UNTIL_STARTED: UNTIL_STARTED, UNTIL_FINISHED: UNTIL_FINISHED}


@dataclass
class UniqueRequest:
    """One pending unique publish, handed from ``send_task`` to ``Enqueuer.put``."""

    name: str
    digest: str
    ttl: float | None
    mode: str = UNTIL_STARTED
    #: Seconds the job waits after the latest enqueue with its key (None: no debounce).
    debounce: float | None = None
    #: Set by the transport: the task id of the job that is pending now (ours or
    #: the one that held the lock).
    holder: str | None = None
    #: The ``AsyncResult`` ``send_task`` returned before the job was written (a bulk
    #: writes it later): :meth:`settle` points it at the pending job.
    result: Any = None

    def settle(self, holder: str) -> None:
        """The write's answer: ``holder`` is the task id of the job pending now. A
        result already handed out (in a bulk) is pointed at it."""
        self.holder = holder
        if self.result is not None and self.result.id != holder:
            logger.debug("celery_ext: %s is already pending as %s; not enqueued again",
                         one_line(self.name), one_line(holder))
            self.result.id = holder


_pending: ContextVar[UniqueRequest | None] = ContextVar("celery_ext_unique", default=None)


def unique_digest(name: str, args: Any, kwargs: Any,
                  key: Callable[..., Any] | None = None) -> str:
    """``<name>:<sha1>`` of the task's unique key (or of its arguments, as JSON)."""
    args = tuple(args or ())
    kwargs = dict(kwargs or {})
    if key is not None:
        raw = str(key(*args, **kwargs))
    else:
        raw = json.dumps([list(args), kwargs], sort_keys=True, default=repr,
                         separators=(",", ":"))
    return f"{name}:{hashlib.sha1(raw.encode('utf-8')).hexdigest()}"


def take_pending(message: dict[str, Any]) -> UniqueRequest | None:
    """The unique request for this message, if ``send_task`` set one for its task."""
    req = _pending.get()
    if req is None or req.holder is not None:
        return None
    headers = message.get("headers")
    if not isinstance(headers, dict) or headers.get("task") != req.name:
        return None
    headers[HEADER] = req.digest
    if req.mode == UNTIL_FINISHED:
        headers[MODE_HEADER] = UNTIL_FINISHED
    return req


def lock_value(mode: str, task_id: str, tag: str) -> str:
    """The lock's value while this message holds it: the task id, followed for a job
    locked until finished by a newline and the message's delivery tag (the scripts'
    ``include/unique.lua`` reads both parts)."""
    return f"{task_id}\n{tag}" if mode == UNTIL_FINISHED else task_id


def finished_lock(headers: Any) -> str | None:
    """The digest of a job locked until finished, from its message headers (else None)."""
    if not isinstance(headers, dict) or headers.get(MODE_HEADER) != UNTIL_FINISHED:
        return None
    digest = headers.get(HEADER)
    return digest if isinstance(digest, str) and digest else None


def lock_of(payload: str | bytes) -> tuple[str, str] | None:
    """(digest, task id) of a stored unique job's message, or None if it is not one.

    The digest travels in the message's ``celery_ext_unique`` header; the lock's value
    while this job holds it is the task id."""
    headers = headers_of(payload)
    digest, task_id = headers.get(HEADER), headers.get("id")
    if isinstance(digest, str) and digest and isinstance(task_id, str) and task_id:
        return digest, task_id
    return None


def unique_mode(task: Any) -> str | None:
    """The task's unique mode, or None for a task that is not unique."""
    value = getattr(task, "unique", False)
    if value is False or value is None:
        return None
    try:
        return MODES[value]
    except (KeyError, TypeError):
        raise ValueError(f"celery_ext: task {task.name!r} has unique={value!r}; it must be "
                         f"True, {UNTIL_STARTED!r} or {UNTIL_FINISHED!r}") from None


def validate_unique_options(task: Any) -> None:
    """Raise ValueError for a unique, unique_ttl, unique_key or debounce a task cannot use."""
    mode = unique_mode(task)
    if mode == UNTIL_FINISHED and not getattr(task, "acks_late", False):
        raise ValueError(f"celery_ext: task {task.name!r} has unique={UNTIL_FINISHED!r} "
                         "without acks_late; set acks_late=True (acked at start, the job "
                         "would release its lock when it starts)")
    debounce = getattr(task, "debounce", None)
    if debounce is not None and (isinstance(debounce, bool)
                                 or not isinstance(debounce, int | float) or debounce <= 0):
        raise ValueError(f"celery_ext: task {task.name!r} has debounce={debounce!r}; "
                         "it must be a number of seconds > 0")
    if debounce is not None and mode is None:
        raise ValueError(f"celery_ext: task {task.name!r} has debounce={debounce!r} "
                         "without unique; set unique=True (and a unique_key)")
    ttl = getattr(task, "unique_ttl", None)
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)
                            or ttl <= 0):
        raise ValueError(f"celery_ext: task {task.name!r} has unique_ttl={ttl!r}; "
                         "it must be a number of seconds > 0")
    key = getattr(task, "unique_key", None)
    if key is not None and not callable(key):
        raise ValueError(f"celery_ext: task {task.name!r} has unique_key={key!r}; "
                         "it must be a function of the task's arguments returning a string")


def _key_of(task: Any) -> Callable[..., Any] | None:
    key = getattr(task, "unique_key", None)
    # A function given as a task option becomes a method of the task class.
    if inspect.ismethod(key) and key.__self__ is task:
        return key.__func__
    return key


def patch_send_task(app: Any) -> None:
    """Wrap ``app.send_task`` so unique tasks go through the unique enqueue."""
    original = app.send_task
    if getattr(original, "_celery_ext_unique", False):
        return

    @functools.wraps(original)
    def send_task(name: str, args: Any = None, kwargs: Any = None, *rest: Any,
                  **options: Any) -> Any:
        task = options.get("task_type") or app._tasks.get(name)
        if not getattr(task, "unique", False) or _pending.get() is not None:
            return original(name, args, kwargs, *rest, **options)
        validate_unique_options(task)
        req = UniqueRequest(name=name, digest=unique_digest(name, args, kwargs, _key_of(task)),
                            ttl=getattr(task, "unique_ttl", None),
                            mode=unique_mode(task) or UNTIL_STARTED,
                            debounce=getattr(task, "debounce", None))
        token = _pending.set(req)
        try:
            result = original(name, args, kwargs, *rest, **options)
        finally:
            _pending.reset(token)
        if req.holder is None:  # written later, by a bulk: it settles the result then
            req.result = result
            return result
        if req.holder != result.id:
            logger.debug("celery_ext: %s is already pending as %s; not enqueued again",
                         one_line(name), one_line(req.holder))
            pending = (options.get("result_cls") or app.AsyncResult)(req.holder)
            pending.ignored = getattr(result, "ignored", False)
            return pending
        return result

    send_task._celery_ext_unique = True  # type: ignore[attr-defined]
    app.send_task = send_task


def release(scripts: Scripts, keys: Keys, digest: str, task_id: str, client: Any,
            renew_ms: int = 0) -> bool:
    """Release a unique job's lock if this job holds it (when it starts or expires); with
    ``renew_ms``, renew its TTL instead (a job locked until finished starts)."""
    return bool(scripts("unique_release", [keys.unique(digest)], [task_id, renew_ms],
                        client=client))
