"""Test app for the job index: ``tests.apps.proj``'s app plus one job the test steers.

Workers run it as ``-A tests.apps.proj_index``. ``gated`` holds while "hold:<key>" exists in
db 2 (so a test sees it running), then fails until "heal:<key>" exists (retrying once,
then dying).
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.apps.proj import app, recorder


@app.task(bind=True, autoretry_for=(ValueError,), max_retries=1, default_retry_delay=1.0)
def gated(self: Any, key: str) -> str:
    r = recorder()
    r.rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}:{self.request.retries}")
    while r.exists(f"hold:{key}"):
        time.sleep(0.02)
    if not r.exists(f"heal:{key}"):
        raise ValueError(f"{key} is broken")
    return "healed"
