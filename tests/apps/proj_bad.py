"""Test app with one task whose options come from ``PROJ_BAD_OPTIONS`` (JSON), so a
test can start a real worker with a bad option (``weight=0``, ``max_concurrency=-1``,
...) and read what it says. Workers run it as ``-A tests.apps.proj_bad``."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.apps.proj import app

OPTIONS: dict[str, Any] = json.loads(os.environ.get("PROJ_BAD_OPTIONS") or "{}")


@app.task(**OPTIONS)
def configured(x: int) -> int:
    return x
