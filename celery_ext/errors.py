"""Errors a producer gets back when celery_ext refuses to enqueue a job, which Redis
errors are the connection's (not the command's), and :class:`Throttled`, which a job
raises to wait.

The two refusals are raised by the transport before (or instead of) writing anything, so a
job is either fully enqueued or not at all. They are not connection errors:
Kombu's publish retry does not loop on them, and ``apply_async`` raises them to
the caller at once.
"""

from __future__ import annotations

import math

import redis
from celery.exceptions import Reject
from kombu.exceptions import OperationalError

#: Errors of the connection: the command may or may not have run, so whoever sent it
#: must find out (reconcile, resend an idempotent script), never assume either way.
#: On a cluster, a master failing over answers CLUSTERDOWN or TRYAGAIN, or leaves a
#: slot without a known owner for a moment: the same "go find out, try again later".
CLUSTER_ERRORS = (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
                  redis.exceptions.SlotNotCoveredError)
CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                     *CLUSTER_ERRORS)


class PayloadTooLarge(ValueError):
    """The encoded job is larger than ``max_payload_bytes``; nothing was enqueued."""

    def __init__(self, name: str, size: int, limit: int) -> None:
        self.name, self.size, self.limit = name, size, limit
        super().__init__(
            f"celery_ext: job {name} is {size:,} bytes encoded, over max_payload_bytes "
            f"({limit:,}); nothing was enqueued. Pass a reference (a key, a URL) instead of "
            "the data, or raise the limit (broker_transport_options['max_payload_bytes'] or "
            "CELERY_EXT_MAX_PAYLOAD_BYTES; 0 = no limit)")


class BrokerOutOfMemory(OperationalError):
    """Redis refused a write (``maxmemory`` reached under ``noeviction``); nothing
    was written. An :class:`~kombu.exceptions.OperationalError`, like the other
    broker failures ``apply_async`` raises."""

    def __init__(self, what: str, error: Exception) -> None:
        # A pipeline's error names its command (binary separators included): keep the reason.
        detail = str(error).rsplit("caused error: ", 1)[-1].strip()
        super().__init__(
            f"celery_ext: {what}: the broker is out of memory ({detail}); nothing was "
            "written. Free memory or raise maxmemory (drain or delete jobs)")


class NotReplicated(OperationalError):
    """``wait_replicas`` is set and fewer replicas than that confirmed an enqueue within
    ``wait_timeout_ms`` (Redis ``WAIT``). The job *is* on the primary and will run
    unless a failover strikes before it reaches a replica; publishing it again may run
    it twice. An :class:`~kombu.exceptions.OperationalError`, not retried by Kombu."""

    def __init__(self, what: str, wanted: int, acked: int, timeout_ms: int) -> None:
        self.wanted, self.acked = wanted, acked
        super().__init__(
            f"celery_ext: {what}: written to the primary but confirmed by {acked} of "
            f"{wanted} replica(s) within {timeout_ms} ms (wait_replicas); a failover now "
            "could lose it. Check the replicas, or lower wait_replicas")


def job_name(message: object, queue: str) -> str:
    """The job name of a Kombu message dict (its ``task`` header), else its queue."""
    headers = message.get("headers") if isinstance(message, dict) else None
    task = headers.get("task") if isinstance(headers, dict) else None
    return task if isinstance(task, str) and task else f"in queue {queue!r}"


def check_payload_size(payload: str, message: object, queue: str, limit: int) -> None:
    """Raise :class:`PayloadTooLarge` if ``payload`` (the JSON about to be written)
    is over ``limit`` bytes; 0 = no limit. O(1) for jobs far below the limit."""
    if not limit or len(payload) <= limit // 4:  # at most 4 bytes per character
        return
    size = len(payload) if payload.isascii() else len(payload.encode("utf-8"))
    if size > limit:
        raise PayloadTooLarge(job_name(message, queue), size, limit)


class DeadJob(Exception):
    """The result of a job that went to the dead set without Celery seeing it end (a poison
    pill, an undecodable or rejected message): its waiters and its chord fail with the
    reason instead of waiting forever (``celery_ext/results/dead_jobs.py``)."""


#: Longest a job may hold its fair key or queue (seconds): one day, the longest interval a
#: rate limit may set (``options/rate_limits.py``), which is also the longest wait the
#: fetch script hands a pool.
MAX_THROTTLE_SECONDS = 86_400.0


class Throttled(Reject):
    """Raised inside a task (``raise celery_ext.Throttled(30)``): "the other side is
    throttling us, back off". The job goes back to the front of its job queue (its fair
    key's sub-queue when it has one) and its fair key, or without one its whole job queue,
    is held ``seconds`` in all pools, while other keys and queues run on. It is not a
    retry nor a recovery: ``max_retries`` and ``max_recoveries`` count nothing, no result
    is stored, and the job keeps its message (``worker/fate.py``, ``throttle.lua``).

    A Celery :class:`~celery.exceptions.Reject` with requeue, so a worker without
    celery_ext's Request class still puts the job back (without the hold)."""

    def __init__(self, seconds: float) -> None:
        try:
            value = float(seconds)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(seconds, bool) or not 0 < value <= MAX_THROTTLE_SECONDS:
            raise ValueError(f"celery_ext: Throttled({seconds!r}): the hold must be a number "
                             f"of seconds > 0 and at most {MAX_THROTTLE_SECONDS:,.0f} (one day)")
        self.seconds = value
        super().__init__(f"throttled for {value:g} s", requeue=True)

    def __reduce__(self) -> tuple[type[Throttled], tuple[float]]:
        # A prefork child sends the exception to the main process pickled: by its hold.
        return (Throttled, (self.seconds,))
