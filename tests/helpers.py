"""Helpers shared by the end-to-end tests: waiting, and reading what the jobs recorded."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import redis

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float, what: str, step: float = 0.05) -> T:
    """Poll ``cond`` until it returns something truthy (returned); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


def recorded(rec: redis.Redis, kind: str, key: str) -> list[str]:
    """What the test apps' tasks pushed to ``<kind>:<key>`` (``runs``, ``start``)."""
    return [v.decode() for v in rec.lrange(f"{kind}:{key}", 0, -1)]
