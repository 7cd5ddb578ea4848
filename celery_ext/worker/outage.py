"""A Redis outage as one component of a worker sees it, logged once when it starts and
once when it ends (not a line per failed write), with its attempts spaced while it lasts.

Used where writes come from many places at once (every job's checkin, every job's end)
and none of them may wait on a Redis that is away: the observer (``observer.py``).
"""

from __future__ import annotations

import logging
import threading
import time

from celery_ext.config import OBSERVER_RETRY_INTERVAL
from celery_ext.text import one_line


class Outage:
    """Redis out of reach for one component (thread-safe).

    ``failed`` after a connection error, ``ok`` after a write that reached Redis;
    ``waiting`` says whether the last failure is too recent to try again
    (``retry_interval``), so callers answer from memory instead of waiting on Redis."""

    __slots__ = ("_lock", "back", "logger", "next_try", "retry_interval", "since",
                 "unavailable")

    def __init__(self, logger: logging.Logger, unavailable: str, back: str,
                 retry_interval: float = OBSERVER_RETRY_INTERVAL) -> None:
        self.logger = logger
        #: What the component does meanwhile, and once it is back (each one line).
        self.unavailable, self.back = unavailable, back
        self.retry_interval = retry_interval
        self._lock = threading.Lock()
        self.since: float | None = None
        self.next_try = 0.0

    def waiting(self) -> bool:
        """An attempt failed less than ``retry_interval`` ago: do not try yet."""
        return self.since is not None and time.monotonic() < self.next_try

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            first = self.since is None
            if first:
                self.since = now
            self.next_try = now + self.retry_interval
        if first:
            self.logger.warning("celery_ext: Redis unavailable, %s: %s", self.unavailable,
                                one_line(str(exc)))

    def ok(self) -> None:
        if self.since is None:  # every write asks: no lock unless an outage ends
            return
        with self._lock:
            since, self.since = self.since, None
        if since is not None:
            self.logger.warning("celery_ext: Redis back after %.1fs, %s", time.monotonic() - since,
                                self.back)
