"""Test app for the job index: ``tests.apps.proj``'s app plus one job the test steers.

Workers run it as ``-A tests.apps.proj_index``. ``gated`` holds while "hold:<key>" exists in
db 2 (so a test sees it running), then fails until "heal:<key>" exists (retrying once,
then dying). ``acked_late`` stores its result and then keeps its child ``ACK_AFTER``
seconds before the pool hears of the end, so a late ack lands that long after the outcome.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task

from tests.apps.proj import app, recorder

#: Seconds between ``acked_late``'s stored result and its ack (with late acks).
ACK_AFTER = 2.5


@app.task(bind=True, autoretry_for=(ValueError,), max_retries=1, default_retry_delay=1.0)
def gated(self: Any, key: str) -> str:
    r = recorder()
    r.rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}:{self.request.retries}")
    while r.exists(f"hold:{key}"):
        time.sleep(0.02)
    if not r.exists(f"heal:{key}"):
        raise ValueError(f"{key} is broken")
    return "healed"


class _AfterReturnWaits(Task):  # type: ignore[misc]
    """Celery calls ``after_return`` after the outcome is stored and before the child
    reports the end to its pool, which acks then (late acks)."""

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(ACK_AFTER)


@app.task(base=_AfterReturnWaits)
def acked_late(key: str) -> str:
    return key
