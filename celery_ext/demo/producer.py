"""The demo's producer: the example jobs of :mod:`celery_ext.demo.app`, enqueued at a
steady rate in a fixed mix (short, long, flaky, scheduled, unique, rate-limited)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Producer:
    """Enqueues the example jobs at a steady rate, in a fixed mix."""

    rate: float
    sent: dict[str, int] = field(default_factory=dict)
    deduplicated: int = 0
    _next: float = 0.0
    _n: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        # Imported here: the app reads CELERY_EXT_BROKER_URL, which the demo sets first.
        from celery_ext.demo import app as jobs

        self.jobs = jobs
        # Per 14 jobs: 8 short, 2 long, one flaky, scheduled, unique and rate-limited.
        self.mix: list[tuple[str, Callable[[int], Any]]] = [
            *[("short", self._short)] * 8, *[("long", self._long)] * 2,
            ("flaky", self._flaky), ("scheduled", self._scheduled),
            ("unique", self._unique), ("rate-limited", self._rate_limited),
        ]
        self._kinds = itertools.cycle(random.sample(self.mix, len(self.mix)))

    def _short(self, i: int) -> Any:
        return self.jobs.send_notice.delay(i)

    def _long(self, i: int) -> Any:
        return self.jobs.build_report.delay(i, steps=12, step_seconds=0.4)

    def _flaky(self, i: int) -> Any:
        return self.jobs.sync_account.delay(i, fail_rate=0.6)

    def _scheduled(self, i: int) -> Any:
        return self.jobs.send_notice.apply_async((i,), countdown=random.uniform(3, 12))

    def _unique(self, i: int) -> Any:
        # Twice the same refresh, due in a few seconds: the second is a duplicate of a
        # pending job (dropped: the caller gets the pending job's id), and so is the
        # first when the same key's job from an earlier round is still pending.
        for attempt in range(2):
            job_id = f"refresh-{i}-{attempt}"
            result = self.jobs.refresh_cache.apply_async((f"key{i % 3}",), task_id=job_id,
                                                          countdown=4)
            if result.id != job_id:
                self.deduplicated += 1
        return result

    def _rate_limited(self, i: int) -> Any:
        return self.jobs.call_partner_api.delay(i)

    def tick(self, now: float) -> None:
        """Send the jobs due by ``now`` (monotonic)."""
        if not self._next:
            self._next = now
        while self._next <= now:
            kind, send = next(self._kinds)
            send(next(self._n))
            self.sent[kind] = self.sent.get(kind, 0) + 1
            self._next += 1.0 / self.rate
