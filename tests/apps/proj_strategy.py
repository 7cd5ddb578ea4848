"""Test app for the shared Request classes (``celery_ext.worker.strategy``).

Workers run it as ``-A tests.apps.proj_strategy`` (``tests.apps.proj``'s app plus these tasks):
three tasks alike but for the settings a Request class captures, so a pool that
wrongly shared one class between them would ack, or time out, the wrong jobs.
"""

from __future__ import annotations

import time

from tests.apps.proj import app, recorder


def _sleep(key: str, seconds: float) -> None:
    r = recorder()
    r.rpush(f"start:{key}", time.time())
    time.sleep(seconds)
    r.rpush(f"end:{key}", time.time())


@app.task(ignore_result=True)
def late_ack(key: str, seconds: float) -> None:
    """acks_late (install's default): owned by its pool while it runs."""
    _sleep(key, seconds)


@app.task(ignore_result=True, acks_late=False)
def early_ack(key: str, seconds: float) -> None:
    """Acked when received: out of the in-flight record while it runs."""
    _sleep(key, seconds)


@app.task(ignore_result=True, time_limit=1)
def limited(key: str, seconds: float) -> None:
    """Killed after 1 s."""
    _sleep(key, seconds)
