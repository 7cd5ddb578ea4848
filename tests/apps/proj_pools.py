"""Test app for worker-pool behaviour (kills, checkin, poison pills).

Tasks leave traces in db 2 of the broker's server: ``runs:<key>`` lists
``"<pid>:<time>"`` per run, so tests count runs without relying on results.
"""

from __future__ import annotations

import os
import time
from typing import Any

import celery_ext
from tests.apps.proj import app, recorder


@app.task(bind=True)
def slow(self: Any, key: str, seconds: float) -> str:
    """A job that runs ``seconds`` and records start and end."""
    r = recorder()
    r.rpush(f"start:{key}", f"{os.getpid()}:{time.time()}")
    time.sleep(seconds)
    r.rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}")
    return key


@app.task(bind=True, stall_after=60)
def long_checkin(self: Any, key: str, seconds: float) -> str:
    """A long job that checks in every 0.2 s and stops early if told to."""
    r = recorder()
    r.rpush(f"start:{key}", f"{os.getpid()}:{time.time()}")
    deadline = time.time() + seconds
    step = 0
    while time.time() < deadline:
        step += 1
        if self.checkin(message=f"step {step}", progress=min(1.0, step * 0.2 / seconds)):
            r.rpush(f"stopped:{key}", str(step))
            return "stopped"
        time.sleep(0.2)
    r.rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}")
    return key


@app.task
def poison(key: str) -> None:
    """Kills its own worker process, every time."""
    recorder().rpush(f"start:{key}", str(os.getpid()))
    os._exit(1)


@app.task(stall_after=1)
def quiet(key: str, seconds: float) -> str:
    """A long job that never checks in: reported stalled after 1 s."""
    time.sleep(seconds)
    return key


@app.task(bind=True, acks_late=True)
def slow_late(self: Any, key: str, seconds: float) -> str:
    """``slow``, acked when it ends also without ``install(app)`` (drop-in mode)."""
    return slow.run(key, seconds)


@app.task(bind=True)
def retry_once(self: Any, key: str, countdown: float) -> int:
    """Retries once after ``countdown`` seconds (through the retry set), then succeeds."""
    recorder().rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}:{self.request.retries}")
    if not self.request.retries:
        raise self.retry(countdown=countdown)
    return self.request.retries


@app.task(ignore_result=True)
def checkin_once(key: str, seconds: float) -> None:
    """Checks in (``celery_ext.checkin``, no install needed) for ``seconds`` on its first
    run only; a rerun returns at once without a checkin, so a checkin left after it is
    the first run's."""
    r = recorder()
    first = r.rpush(f"start:{key}", f"{os.getpid()}:{time.time()}") == 1
    deadline = time.time() + (seconds if first else 0)
    while time.time() < deadline:
        celery_ext.checkin(message="working")
        time.sleep(0.1)
    r.rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}")


@app.task(ignore_result=True)
def fail_after(key: str, seconds: float) -> None:
    """Fails after ``seconds``, storing no result: many at once fail together (a green
    executor's burst), nothing between the failure and the dead set."""
    time.sleep(seconds)
    raise ValueError(f"{key} fails")
