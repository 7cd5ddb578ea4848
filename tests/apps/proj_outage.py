"""Test app for faults under a job that checks in (issue 33): a Redis outage (the job
writes its steps to a file, not to Redis, which the test kills), and a worker pool
killed whole right after a job's first checkin."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from tests.apps.proj import app


@app.task(bind=True)
def stepping(self: Any, path: str, steps: int, pause: float) -> int:
    """Runs ``steps`` steps of ``pause`` seconds, checking in at each; appends each
    step's number to ``path`` so the test counts the steps run without Redis."""
    for step in range(1, steps + 1):
        self.checkin(message=f"step {step}", progress=step / steps)
        with open(path, "a") as out:
            out.write(f"{step}\n")
        time.sleep(pause)
    return steps


@app.task(bind=True)
def checkin_then_die(self: Any) -> None:
    """Checks in once, then SIGKILLs its whole worker pool (the worker's process group:
    main process and children) before the pool's background thread, which writes a busy
    record ``BUSY_RECORD_DELAY`` after the start, had its turn."""
    self.checkin(message="first", progress=0.0)
    os.killpg(os.getpgid(0), signal.SIGKILL)


__all__ = ["app", "checkin_then_die", "stepping"]
