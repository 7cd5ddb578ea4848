"""Resumable jobs: the cursor a long job keeps so that its next run goes on from there.

A job calls ``self.checkin(cursor=...)`` with a small JSON-able value (a position: an
offset, the last id done, a page token). When the job runs again without having
finished (recovered from a dead pool or a dead prefork child, returned at a warm
shutdown by raising :class:`Interrupted`, or retried), that run reads the value as
``self.cursor`` (None on a first run) and resumes.

*Where it lives.* ``{ns}:cursor:<task id>`` (``Keys.cursor``) in the job queue's copy of
the layout, the slot of the job's in-flight record, so it stays with the job through
every move, and each move that ends the job removes it in the same script: the ack of
the run that owns it (``ack.lua``: the job finished), dead-lettering (``dead.lua``) and
a poison pill (``recover.lua``): a dead job keeps no cursor, and one retried from the
dead set starts over. Its TTL (``cursor_ttl``, renewed at each write) bounds a cursor
whose job nobody ends (purged from its queue, lost with the server's data).

*Whose it is.* The value starts with the delivery tag of the run that owns it: a run
owns it from its first read or write, and only the owner's ack removes it. A retry is a
new message (a new tag) of a job that has not finished: the run that retries gives its
cursor up (owner "") before Celery acks it, so that ack leaves it to the retry, whose
run takes it over when it reads it. A job acked when it started (``acks_late`` off)
has no ack at its end: its run removes the cursor it owns when it succeeds.

*Cost.* The read is lazy: the first access of ``self.cursor`` in a run is one round
trip, later ones and jobs that never ask cost nothing. A job writes its cursor at most
once per ``cursor_interval``; the latest is written at once when its checkin answers
"stop" (a warm shutdown: the job goes back with its last position) and when a run ends
without finishing (retry, interrupt, failure). A SIGKILL loses at most the writes of
the last interval: the steps since are done again (delivery stays at least once).

Every function here runs in the job's own execution slot (prefork child, thread,
greenlet), where Celery's ``task_postrun`` runs too, before the job's result reaches
the main process that acks it. State is per job id, so slots do not share it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from celery.exceptions import Reject
from celery.signals import task_postrun

from celery_ext.errors import CONNECTION_ERRORS
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.worker.cursor")

#: ``checkin(cursor=...)`` not given: the cursor is left as it is.
UNSET: Any = object()
#: A run's cursor not read from Redis yet.
_UNREAD: Any = object()


class Interrupted(Reject):
    """Raised by a resumable job that stops before its end (its checkin answered "stop":
    the pool is shutting down): the job goes back to the front of its queue with its
    cursor, and its next run, on any pool, resumes from there. Celery's ``Reject`` with
    requeue, so it needs the job acked when it ends (``acks_late``, which
    ``install(app)`` defaults): a job acked when it started cannot go back."""

    def __init__(self, reason: Any = "interrupted: back to its queue, to resume from its "
                 "cursor", requeue: bool = True) -> None:
        super().__init__(reason, requeue=requeue)


class _Run:
    """One run of a job that uses its cursor."""

    __slots__ = ("key", "last_write", "name", "obs", "pending", "refused", "tag", "value")

    def __init__(self, obs: Any, key: str, tag: str, name: str) -> None:
        self.obs = obs
        self.key = key
        self.tag = tag
        self.name = name
        self.value: Any = _UNREAD
        self.pending: str | None = None  # JSON not written yet
        self.last_write = 0.0
        self.refused = False  # a cursor was refused: said once per run


_runs: dict[str, _Run] = {}


def _run_of(obs: Any, task: Any) -> _Run | None:
    request = task.request
    if obs is None or request.id is None or request.called_directly:
        return None
    run = _runs.get(request.id)
    if run is None:
        # The in-flight record's copy: the job queue, as the observer names it.
        queue = (request.delivery_info or {}).get("routing_key") or task.name
        tag = (getattr(request, "properties", None) or {}).get("delivery_tag") or ""
        run = _runs[request.id] = _Run(obs, obs.keys.of(queue).cursor(request.id),
                                       str(tag), task.name)
    return run


def _ttl_ms(run: _Run) -> int:
    return int(run.obs.settings.cursor_ttl * 1000)


def read(obs: Any, task: Any) -> Any:
    """``self.cursor``: the job's cursor, read once per run (None: there is none).
    Redis out of reach raises: a job that cannot learn where it was must not start over
    unaware (Celery's retry policy decides, as for any failure)."""
    run = _run_of(obs, task)
    if run is None:
        return None
    if run.value is _UNREAD:
        raw = run.obs.scripts("cursor", [run.key], ["read", run.tag, "", _ttl_ms(run)])
        run.value = None if raw is None else json.loads(raw)
    return run.value


def task_cursor(task: Any) -> Any:
    """``self.cursor`` of a task (a property every task of a worker's app gets)."""
    from celery_ext.worker.observer import Observer  # (which imports this module)

    return read(Observer.for_app(task.app), task)


def save(obs: Any, task: Any, cursor: Any, stopping: bool) -> None:
    """``checkin(cursor=...)``: keep ``cursor`` as the job's; written now if the last
    write is ``cursor_interval`` old or the job is asked to stop, else later (the latest
    wins). A cursor that is not JSON or is over ``cursor_max_bytes`` is refused with
    one error line per run; the job runs on and its previous cursor stays."""
    run = _run_of(obs, task)
    if run is None:
        return
    settings = run.obs.settings
    try:
        text = json.dumps(cursor, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        _refuse(run, task, f"is not JSON ({type(exc).__name__}: {exc})")
        return
    size = len(text.encode("utf-8"))
    if size > settings.cursor_max_bytes:
        _refuse(run, task, f"is {size:,} bytes as JSON, over cursor_max_bytes "
                f"({settings.cursor_max_bytes:,}): keep a position (an id, an offset), "
                "not data, or raise the setting")
        return
    run.value = json.loads(text)  # what the next run will read (a tuple reads as a list)
    run.pending = text
    if stopping or time.monotonic() - run.last_write >= settings.cursor_interval:
        _write(run, run.tag)


def _refuse(run: _Run, task: Any, why: str) -> None:
    if not run.refused:
        run.refused = True
        logger.error("celery_ext: job %s[%s]: its cursor %s; not kept, the job runs on",
                     one_line(run.name), one_line(task.request.id or ""), one_line(why))


def _write(run: _Run, owner: str) -> None:
    """Write the pending cursor (owned by ``owner``); Redis out of reach keeps it
    pending for the next checkin or the run's end."""
    text = run.pending if run.pending is not None else json.dumps(run.value,
                                                                  separators=(",", ":"))
    try:
        run.obs.scripts("cursor", [run.key], ["save", owner, text, _ttl_ms(run)])
    except CONNECTION_ERRORS as exc:
        logger.warning("celery_ext: could not write the cursor of job %s (written at its "
                       "next checkin): %s", one_line(run.name), one_line(str(exc)))
        return
    finally:
        run.last_write = time.monotonic()
    run.pending = None


@task_postrun.connect(weak=False)
def _on_postrun(sender: Any = None, task_id: str | None = None, task: Any = None,
                state: str | None = None, retval: Any = None, **kw: Any) -> None:
    """A run ends: a finished job's cursor goes (with its ack, or here if it was acked
    when it started); a run that did not finish writes its latest cursor, given up to
    the retry if it retried."""
    if isinstance(retval, Interrupted) and task is not None and not task.acks_late:
        logger.error("celery_ext: job %s[%s] raised Interrupted, but it was acked when it "
                     "started (acks_late off): it does not go back to its queue. Set "
                     "task_acks_late (or acks_late=True on the task) for resumable jobs",
                     one_line(task.name), one_line(task_id or ""))
    run = _runs.pop(task_id or "", None)
    if run is None or task is None:
        return
    try:
        if state == "SUCCESS":
            if not task.acks_late:  # acked at its start: no ack removes it
                run.obs.scripts("cursor", [run.key], ["drop", run.tag, "", 0])
        elif state == "RETRY":
            if run.value is not _UNREAD and run.value is not None:
                _write(run, "")
        elif run.pending is not None:
            _write(run, run.tag)
    except Exception as exc:
        logger.warning("celery_ext: could not update the cursor of job %s[%s]: %s",
                       one_line(run.name), one_line(task_id or ""), one_line(str(exc)))


def _forget_after_fork() -> None:
    _runs.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
