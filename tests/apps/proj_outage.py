"""Test app for a Redis outage under a running job (issue 33): the job checks in at
every step and writes its steps to a file, not to Redis, which the test kills."""

from __future__ import annotations

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


__all__ = ["app", "stepping"]
