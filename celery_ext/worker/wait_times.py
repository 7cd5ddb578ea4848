"""Queue wait time: how long a job waited in its job queue before its run started.

From the job's ``enqueued_at`` (stamped by the producer on the Redis clock, and for a
countdown/eta job its due time: ``producer/publish.py``) to the moment its run starts,
read on the same clock: this host's time plus the offset its channel measured with
``TIME`` when it was made (a prefork child makes its own). Host clocks may be skewed;
each side corrects its own, so a job's wait costs no round trip.

The observer adds a job's wait to its ``{ns}:runtime`` fields when the run starts
(``wait_<bucket>:<queue>`` and ``wait_sum_us:<queue>``) and writes them with the runtime
histogram in its counter flush, one HINCRBY per field per flush. The metrics endpoint
shows them as ``celery_ext_job_wait_seconds`` (``admin/metrics.py``).

A job returned to its queue (its pool died, a warm shutdown handed it back) keeps its
``enqueued_at``: its next start counts from the first enqueue. A retry is a new message
and counts from its own due time.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from celery_ext.config import WAIT_BUCKETS
from celery_ext.store.keys import WAIT_BUCKET_NAMES, WAIT_SUM_PREFIX


def wait_bucket(seconds: float) -> str:
    """The ``{ns}:runtime`` field prefix of a wait this long (bounds are inclusive, as
    Prometheus' ``le``)."""
    return WAIT_BUCKET_NAMES[bisect.bisect_left(WAIT_BUCKETS, seconds)]


def enqueued_at(request: Any) -> float | None:
    """The job's ``enqueued_at`` (Redis time, seconds), or None for a message our
    producer did not write (published by another client, or called directly)."""
    properties = getattr(request, "properties", None)
    stamp = properties.get("enqueued_at") if isinstance(properties, dict) else None
    if isinstance(stamp, bool) or not isinstance(stamp, int | float):
        return None
    return float(stamp)


def wait_fields(request: Any, queue: str, clock_offset: float) -> list[tuple[str, int]]:
    """The ``{ns}:runtime`` increments of a job whose run starts now: its bucket and its
    wait in microseconds (none when its message carries no ``enqueued_at``). A wait below
    zero (the two offsets measured a few milliseconds apart) counts as zero."""
    stamp = enqueued_at(request)
    if stamp is None:
        return []
    seconds = max(0.0, time.time() + clock_offset - stamp)
    return [(f"{wait_bucket(seconds)}:{queue}", 1),
            (f"{WAIT_SUM_PREFIX}:{queue}", int(seconds * 1e6))]
