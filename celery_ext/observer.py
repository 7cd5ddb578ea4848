"""Busy workers and checkin: what each execution slot runs now, and long-job progress.

Written from the process that runs the job (a prefork child, a thread, the solo
worker), through Celery's ``task_prerun``/``task_postrun`` signals. ``checkin()``
records progress at most once per ``CHECKIN_MIN_INTERVAL`` per job and tells the job
whether to stop: its pool is shutting down, or someone asked through the client API.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from celery import current_task
from celery.signals import task_postrun, task_prerun

from .config import Settings
from .heartbeater import owning_pool_id
from .keys import Keys
from .scripts import Scripts

logger = logging.getLogger("celery_ext.observer")

#: A job writes its checkin to Redis at most this often (seconds), however often it calls.
CHECKIN_MIN_INTERVAL = 1.0
#: Characters of repr(args)/repr(kwargs) kept in a busy worker's record.
ARGS_PREVIEW_CHARS = 200

_observers: dict[int, Observer] = {}
_observers_lock = threading.Lock()


def slot_id() -> str:
    """This execution slot: the process, plus the thread for the threads pool."""
    if threading.current_thread() is threading.main_thread():
        return str(os.getpid())
    return f"{os.getpid()}-{threading.get_ident()}"


def preview(args: Any, kwargs: Any) -> str:
    text = ", ".join([*(repr(a) for a in (args or ())),
                      *(f"{k}={v!r}" for k, v in (kwargs or {}).items())])
    return text if len(text) <= ARGS_PREVIEW_CHARS else text[:ARGS_PREVIEW_CHARS - 1] + "…"


class _CheckinState:
    __slots__ = ("answer", "last_write", "pending")

    def __init__(self) -> None:
        self.last_write = 0.0
        self.answer = False
        self.pending: dict[str, Any] | None = None


class Observer:
    """Records this process's running jobs for its pool (one per process and app)."""

    def __init__(self, client: Any, settings: Settings, pool_id: str) -> None:
        self.client = client
        self.settings = settings
        self.pool_id = pool_id
        self.keys = Keys(settings.namespace)
        self.scripts = Scripts(client)
        self._checkins: dict[str, _CheckinState] = {}

    @classmethod
    def for_app(cls, app: Any) -> Observer | None:
        """The observer of this process, or None when the broker is not ours."""
        key = id(app)
        with _observers_lock:
            obs = _observers.get(key)
            if obs is None:
                conn = app.connection_for_write()
                channel = conn.default_channel
                if not hasattr(channel, "_new_sync_client"):
                    return None
                obs = _observers[key] = cls(channel._new_sync_client(), channel.settings,
                                            owning_pool_id())
            return obs

    def _busy(self, mode: str, job_id: str, record: str = "", queue: str = "",
              outcome: str = "") -> None:
        self.scripts("busy", [self.keys.busy(self.pool_id), self.keys.checkins,
                              self.keys.stop_requests, self.keys.stats],
                     [slot_id(), mode, job_id, record, queue, outcome])

    def job_started(self, task: Any, job_id: str, args: Any, kwargs: Any) -> None:
        record = json.dumps({
            "job_id": job_id,
            "job_name": task.name,
            "args": preview(args, kwargs),
            "stall_after": getattr(task, "stall_after", None),
            "pid": os.getpid(),
        }, default=repr, separators=(",", ":"))
        self._busy("start", job_id, record)

    def job_finished(self, job_id: str, queue: str = "", outcome: str = "") -> None:
        self._checkins.pop(job_id, None)
        self._busy("end", job_id, queue=queue, outcome=outcome)

    def checkin(self, job_id: str, message: str | None = None,
                progress: float | None = None) -> tuple[bool, bool]:
        """Record progress (throttled). Returns (should stop, written now)."""
        state = self._checkins.get(job_id)
        if state is None:
            state = self._checkins[job_id] = _CheckinState()
        state.pending = {"message": message, "progress": progress}
        now = time.monotonic()
        if state.last_write and now - state.last_write < CHECKIN_MIN_INTERVAL:
            return state.answer, False
        stop, pool_state, _ = self.scripts(
            "checkin",
            [self.keys.checkins, self.keys.stop_requests, self.keys.pool(self.pool_id)],
            [job_id, json.dumps(state.pending, default=repr, separators=(",", ":"))])
        state.last_write = now
        state.pending = None
        state.answer = bool(stop) or (pool_state or b"") in (b"stopping", "stopping")
        return state.answer, True


def checkin(message: str | None = None, progress: float | None = None,
            task: Any = None) -> bool:
    """Report progress of the running job; True means "stop now, cleanly".

    True when the job's worker pool is shutting down (warm shutdown) or someone asked
    this job to stop (``celery_ext.client``). Writes at most once per second per job,
    however often it is called; also emits a ``task-progress`` Celery event (Flower).
    """
    task = task or current_task
    if task is None or task.request.id is None or task.request.called_directly:
        return False
    obs = Observer.for_app(task.app)
    if obs is None:
        return False
    answer, written = obs.checkin(task.request.id, message, progress)
    if written:
        try:
            task.send_event("task-progress", message=message, progress=progress)
        except Exception:  # events are best effort; the Redis record is the truth
            logger.debug("celery_ext: could not send task-progress event", exc_info=True)
    return answer


def _task_checkin(self: Any, message: str | None = None, progress: float | None = None) -> bool:
    return checkin(message, progress, task=self)


@task_prerun.connect(weak=False)
def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None,
               args: Any = None, kwargs: Any = None, **kw: Any) -> None:
    if task is None or task_id is None or not getattr(task.app, "_celery_ext_installed", False):
        return
    try:
        obs = Observer.for_app(task.app)
        if obs is not None:
            obs.job_started(task, task_id, args, kwargs)
    except Exception as exc:
        logger.warning("celery_ext: could not record busy worker for %s: %s", task_id, exc)


#: Celery end state of a run -> the stats counter it increments.
OUTCOMES = {"SUCCESS": "processed", "FAILURE": "failed", "RETRY": "retried"}


@task_postrun.connect(weak=False)
def _on_postrun(sender: Any = None, task_id: str | None = None, task: Any = None,
                state: str | None = None, **kw: Any) -> None:
    if task is None or task_id is None or not getattr(task.app, "_celery_ext_installed", False):
        return
    try:
        obs = Observer.for_app(task.app)
        if obs is not None:
            info = task.request.delivery_info or {}
            queue = info.get("routing_key") or task.name
            obs.job_finished(task_id, queue=queue, outcome=OUTCOMES.get(state or "", ""))
    except Exception as exc:
        logger.warning("celery_ext: could not clear busy worker for %s: %s", task_id, exc)
