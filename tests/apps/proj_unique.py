"""Test app for the unique modes: locked until finished, and debounce (issue 35).

Workers run it as ``-A tests.apps.proj_unique`` (``tests.apps.proj``'s app plus these
tasks; each says ``acks_late=True``, which ``unique="until_finished"`` needs, so that a
drop-in worker of ``tests.apps.proj`` in the same test process, where these tasks are
registered too, starts). Tasks leave traces in db 2 of the broker's server:
``start:<key>`` when a run starts, ``runs:<key>`` when it ends.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.apps.proj import app, recorder


@app.task(bind=True, acks_late=True, unique="until_finished",
          unique_key=lambda key, seconds=0.0: key)
def held(self: Any, key: str, seconds: float = 0.0) -> None:
    """Locked from its enqueue until it finishes: one per ``key`` at a time."""
    r = recorder()
    r.rpush(f"start:{key}", f"{os.getpid()}:{self.request.id}")
    time.sleep(seconds)
    r.rpush(f"runs:{key}", f"{os.getpid()}:{self.request.id}")


@app.task(bind=True, acks_late=True, unique="until_finished", unique_key=lambda key: key,
          max_retries=1)
def held_retry(self: Any, key: str) -> None:
    """Fails its first run and retries 1.5 s later, under the same lock; the retry's run
    takes 1.5 s."""
    recorder().rpush(f"runs:{key}", str(self.request.retries))
    if self.request.retries == 0:
        raise self.retry(countdown=1.5)
    time.sleep(1.5)
    recorder().rpush(f"done:{key}", str(self.request.retries))


@app.task(unique=True, unique_key=lambda key: key)
def started(key: str) -> None:
    """Locked from its enqueue until it starts (until_started)."""
    recorder().rpush(f"runs:{key}", "s")


@app.task(acks_late=True, unique="until_finished", unique_key=lambda key: key)
def held_fails(key: str) -> None:
    """Fails 1 s after it starts, without retries: it goes to the dead set, and its
    lock with it."""
    recorder().rpush(f"runs:{key}", "x")
    time.sleep(1.0)
    raise ValueError(f"{key} fails")


@app.task(unique=True, unique_key=lambda key, n: key, debounce=2.0)
def debounced(key: str, n: int) -> None:
    """Runs 2 s after the latest enqueue for ``key``, with that enqueue's ``n``."""
    recorder().rpush(f"runs:{key}", str(n))


@app.task(bind=True, acks_late=True, unique="until_finished", unique_key=lambda key, n: key,
          debounce=1.0)
def debounced_held(self: Any, key: str, n: int) -> None:
    """Debounced, then locked until it finishes (a run takes 2 s)."""
    recorder().rpush(f"start:{key}", f"{n}:{self.request.id}")
    time.sleep(2.0)
    recorder().rpush(f"runs:{key}", str(n))
