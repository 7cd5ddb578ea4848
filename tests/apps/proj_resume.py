"""Test app of resumable jobs on one node (``-A tests.apps.proj_resume``): the job of
``tests/apps/resumable.py`` on the app of ``tests/apps/proj.py`` (install or drop-in)."""

from __future__ import annotations

from typing import Any

from tests.apps.proj import app
from tests.apps.resumable import INTERRUPTED, checkin_step, run_steps


@app.task(bind=True)
def resumable(self: Any, path: str, steps: int, pause: float) -> int:
    return run_steps(self, path, steps, pause)


__all__ = ["app", "big_cursor", "fails_with_cursor", "interrupts", "resumable", "retried"]


@app.task(bind=True, max_retries=1)
def retried(self: Any, path: str, steps: int, retry_after: int) -> int:
    """Retries once after step ``retry_after``; the retry's run goes on from its cursor."""
    start = getattr(self, "cursor", None) or 0
    with open(path, "a") as out:
        out.write(f"start {start}\n")
    for step in range(start + 1, steps + 1):
        with open(path, "a") as out:
            out.write(f"{step}\n")
        checkin_step(self, step, steps)
        if step == retry_after and not self.request.retries:
            raise self.retry(countdown=0.2)
    with open(path, "a") as out:
        out.write("done\n")
    return steps


@app.task(bind=True)
def big_cursor(self: Any, size: int) -> Any:
    """Checks in three times with a cursor over the limit: refused, the job runs on."""
    for _ in range(3):
        self.checkin(message="big", cursor="x" * size)
    return self.cursor


@app.task(bind=True)
def fails_with_cursor(self: Any) -> None:
    """Keeps a cursor, then fails for good: it goes to the dead set without it."""
    self.checkin(message="one", cursor={"page": 1})
    raise ValueError("this job fails")


@app.task(bind=True)
def interrupts(self: Any) -> None:
    """Raises Interrupted at once (run where it is acked when it starts: it cannot go back)."""
    self.checkin(message="one", cursor=1)
    raise INTERRUPTED()
