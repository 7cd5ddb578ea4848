"""A job running in this process, as its busy-worker record shows it.

The observer (``observer.py``) keeps one :class:`RunningJob` per job it sees start and
writes its record only if the job runs past ``BUSY_RECORD_DELAY``; :func:`slot_id` names
the execution slot the record is filed under.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

#: Characters of repr(args)/repr(kwargs) kept in a busy worker's record.
ARGS_PREVIEW_CHARS = 200

#: This process's pid, as text (``os.getpid`` is a system call; a job asks twice).
_pid = str(os.getpid())


def _renew_pid_after_fork() -> None:
    """A prefork child files its jobs under its own pid, not its parent's."""
    global _pid
    _pid = str(os.getpid())


os.register_at_fork(after_in_child=_renew_pid_after_fork)


def slot_id() -> str:
    """This execution slot: the process, plus the thread for the threads pool (the
    greenlet under gevent). By ident, not ``current_thread()``: under gevent that makes
    a thread object for each job's greenlet."""
    ident = threading.get_ident()
    if ident == threading.main_thread().ident:
        return _pid
    return f"{_pid}-{ident}"


def preview(args: Any, kwargs: Any) -> str:
    """The job's arguments as its busy record shows them, cut to ``ARGS_PREVIEW_CHARS``."""
    text = ", ".join([*(repr(a) for a in (args or ())),
                      *(f"{k}={v!r}" for k, v in (kwargs or {}).items())])
    return text if len(text) <= ARGS_PREVIEW_CHARS else text[:ARGS_PREVIEW_CHARS - 1] + "…"


class RunningJob:
    """A job running in this process. Its busy record is written only if it runs past
    ``BUSY_RECORD_DELAY``, which most jobs never do, so the start keeps references (the
    task, its arguments) and the record is made only then: the arguments are previewed
    as they are at that moment."""

    __slots__ = ("args", "job_id", "kwargs", "slot", "started", "task", "written")

    def __init__(self, job_id: str, task: Any, args: Any, kwargs: Any, slot: str) -> None:
        self.job_id = job_id
        self.task = task
        self.args = args
        self.kwargs = kwargs
        self.slot = slot
        self.started = time.monotonic()
        self.written = False

    @property
    def record(self) -> str:
        try:
            args = preview(self.args, self.kwargs)
        except Exception as exc:  # the job's own __repr__, or a thread changing them
            args = f"<arguments not shown: {type(exc).__name__}>"
        return json.dumps({
            "job_id": self.job_id,
            "job_name": self.task.name,
            "args": args,
            "stall_after": getattr(self.task, "stall_after", None),
            "pid": int(_pid),
        }, default=repr, separators=(",", ":"))
