"""In-memory time series for the overview plots: throughput and queue sizes.

The dashboard process samples the counters every ``interval`` seconds and keeps
``history`` seconds of points; nothing is stored in Redis, so the plots start empty
when the dashboard starts. ``sample()`` is the synchronous one-shot step.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, TypedDict

logger = logging.getLogger("celery_ext.admin.web")

#: Seconds between two samples.
DEFAULT_INTERVAL = 2.0
#: Seconds of history kept (and plotted).
DEFAULT_HISTORY = 600.0


class Point(TypedDict):
    t: float  # Redis-clock seconds
    processed: int
    failed: int
    retried: int
    queued: int
    in_flight: int
    scheduled: int
    retry: int
    dead: int
    busy: int


class Series(TypedDict):
    t: list[float]
    processed_rate: list[float]  # jobs/s between two samples
    failed_rate: list[float]
    queued: list[int]
    in_flight: list[int]
    scheduled: list[int]
    retry: list[int]
    dead: list[int]


class Sampler:
    """Keeps the last ``history`` seconds of overview counters."""

    def __init__(self, client: Any, interval: float = DEFAULT_INTERVAL,
                 history: float = DEFAULT_HISTORY) -> None:
        self.client = client
        self.interval = interval
        self.points: deque[Point] = deque(maxlen=max(2, int(history / interval) + 1))
        self._lock = threading.Lock()

    def sample(self) -> Point:
        """Read the counters once and append a point."""
        totals = self.client.totals()
        queues = self.client.job_queues()
        sizes = self.client.counts()
        point = Point(
            t=self.client.server_time(),
            processed=totals.get("processed", 0),
            failed=totals.get("failed", 0),
            retried=totals.get("retried", 0),
            queued=sum(q["size"] for q in queues),
            in_flight=sum(q["in_flight"] for q in queues),
            scheduled=sizes.get("scheduled", 0),
            retry=sizes.get("retry", 0),
            dead=sizes.get("dead", 0),
            busy=len(self.client.busy_workers()),
        )
        with self._lock:
            self.points.append(point)
        return point

    def series(self) -> Series:
        with self._lock:
            points = list(self.points)
        out = Series(t=[], processed_rate=[], failed_rate=[], queued=[], in_flight=[],
                     scheduled=[], retry=[], dead=[])
        prev: Point | None = None
        for p in points:
            if prev is not None:
                dt = p["t"] - prev["t"]
                out["t"].append(p["t"])
                # Counters only grow; a drop means they were reset: plot zero.
                out["processed_rate"].append(
                    max(0.0, (p["processed"] - prev["processed"]) / dt) if dt > 0 else 0.0)
                out["failed_rate"].append(
                    max(0.0, (p["failed"] - prev["failed"]) / dt) if dt > 0 else 0.0)
                for name in ("queued", "in_flight", "scheduled", "retry", "dead"):
                    out[name].append(p[name])
            prev = p
        return out

    def latest(self) -> Point | None:
        with self._lock:
            return self.points[-1] if self.points else None
