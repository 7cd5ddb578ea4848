"""The resumable job of the resumable-job tests (issue 35), shared by the apps that run it
on one node (``proj_resume``) and on a cluster (``proj_resume_cluster``).

Each step "works" for ``pause`` seconds, then appends its number to a file (the test
counts the steps done without Redis, which it may take down) and checks in with the
step as the job's cursor. A run appends "start <cursor>" first, so the test sees where
each run resumed. Against a plugin without resumable jobs (the tests run against the
code before them) it checks in without a cursor and starts over at every run.
"""

from __future__ import annotations

import time
from typing import Any

import celery_ext

#: ``celery_ext.Interrupted``, or None before resumable jobs existed.
INTERRUPTED: Any = getattr(celery_ext, "Interrupted", None)


def checkin_step(task: Any, step: int, steps: int) -> bool:
    try:
        return bool(task.checkin(message=f"step {step}", progress=step / steps, cursor=step))
    except TypeError:  # no cursor= (the plugin before resumable jobs)
        return bool(task.checkin(message=f"step {step}", progress=step / steps))


def run_steps(task: Any, path: str, steps: int, pause: float) -> int:
    start = getattr(task, "cursor", None) or 0
    with open(path, "a") as out:
        out.write(f"start {start}\n")
    for step in range(start + 1, steps + 1):
        time.sleep(pause)
        with open(path, "a") as out:
            out.write(f"{step}\n")
        if checkin_step(task, step, steps) and step < steps:
            if INTERRUPTED is None:
                return step  # stopped early: before resumable jobs, nothing brings it back
            raise INTERRUPTED()
    with open(path, "a") as out:
        out.write("done\n")
    return steps


def read_steps(path: Any) -> tuple[list[int], list[int], bool]:
    """(the steps done in order, the cursor each run started from, finished) of a file."""
    try:
        lines = path.read_text().split()
    except FileNotFoundError:
        return [], [], False
    steps, starts, done = [], [], False
    words = iter(lines)
    for word in words:
        if word == "start":
            starts.append(int(next(words)))
        elif word == "done":
            done = True
        else:
            steps.append(int(word))
    return steps, starts, done
