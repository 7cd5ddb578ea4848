"""The shapes the admin side hands out: one typed dict per kind of row.

The Python client (:class:`celery_ext.client.Client`) returns them and the JSON API
(``celery_ext.admin.web``) serves them as they are, so a field named here is a field of
both; ``docs/dashboard.md`` and ``docs/sets.md`` describe them. Times are seconds on
the Redis clock. The history's shapes (:class:`Series`, :class:`Runtime`) are the
store's, where the history is kept, and the queue's fair keys (:class:`FairInfo`) are
the fair-key option's; they are named here too so that one import finds every shape.
"""

from __future__ import annotations

from typing import Any, Generic, TypedDict, TypeVar

from celery_ext.options.fair import FairInfo
from celery_ext.store.history import Runtime, Series

__all__ = ["BusyWorker", "DeadJob", "FairInfo", "JobStatus", "Page", "PendingChord", "PoolInfo",
           "QueueInfo", "Runtime", "ScheduledJob", "SearchPage", "Series", "SetCounts"]

T = TypeVar("T")


# -- chords of the result backend (celery_ext.results.chords) ---------------------------------
class PendingChord(TypedDict):
    group_id: str
    counted: int  # header results counted (a job run twice counts once)
    size: int | None  # header jobs the body waits for (None: not known yet)
    applied_at: float


# -- queues, pools, busy workers (celery_ext.admin.overview) -----------------------------------
class QueueInfo(TypedDict):
    name: str
    size: int
    latency: float | None  # seconds since the oldest queued job was enqueued
    weight: int
    paused: bool
    max_concurrency: int | None
    rate_limit: str | None  # cluster-wide, e.g. "20/s" (rate_limits.py)
    #: Seconds until its next job may be fetched: its rate limit's next slot, or a hold
    #: a job set by raising ``Throttled``; None when a job may be fetched now.
    not_due_for: float | None
    in_flight: int
    processed: int
    failed: int
    #: A queue with keyed jobs waiting: its active fair keys (count, biggest); else None.
    fair: FairInfo | None
    #: A live worker pool consumes it. False: its jobs wait for a pool that knows the
    #: task (a typo in a task name, or a deploy not yet rolled out); they are kept.
    consumed: bool


class PoolInfo(TypedDict):
    pool_id: str
    node: str
    host: str
    pid: int | None
    concurrency: str
    pool_type: str
    queues: list[str]
    started_at: float | None
    heartbeat_age: float | None  # seconds, by Redis time
    state: str  # running, stopping, dead (heartbeat older than its dead_after), orphaned
    in_flight: int


class BusyWorker(TypedDict):
    pool_id: str
    slot: str
    job_id: str
    job_name: str
    args: str
    started_at: float
    checkin_at: float | None
    checkin_message: str | None
    progress: float | None
    stall_after: float | None
    stalled: bool
    stop_requested: bool


# -- the scheduled, retry and dead sets (celery_ext.admin.job_sets) -----------------------------
class Page(TypedDict, Generic[T]):
    items: list[T]
    total: int  # matching jobs in the whole set
    offset: int
    limit: int


class ScheduledJob(TypedDict):
    id: str  # the job's id in the set (its delivery tag)
    name: str
    task_id: str | None
    queue: str
    args: Any
    kwargs: Any
    due_at: float  # when the requeuer moves it to its job queue
    scheduled_at: float | None
    retry: bool  # in the retry set (a retry of a failed attempt)
    attempt: int  # retries so far (0 for a plain countdown/eta job)
    error: str | None  # last error, for retries
    exc_type: str | None
    traceback: str | None
    eta: str | None
    expires: str | None


class DeadJob(TypedDict):
    id: str  # the job's id in the dead set (its delivery tag)
    name: str
    task_id: str | None
    queue: str
    reason: str  # see celery_ext.store.dead_set.REASONS
    error: str
    exc_type: str | None
    exc_message: str | None
    traceback: str | None
    args: Any
    kwargs: Any
    attempts: int | None
    pool: str | None
    hostname: str | None
    failed_at: float
    manual_retries: int
    payload: str | None  # the raw message (show one only)
    fair_key: str | None  # the job's fair key (fair.py), if it has one


class SetCounts(TypedDict):
    scheduled: int
    retry: int
    dead: int


class SearchPage(TypedDict):
    items: list[Any]  # DeadJob or ScheduledJob
    cursor: str | None  # where the next page starts; None: no more
    scanned: int


# -- one job (celery_ext.admin.job_status) -----------------------------------------------------
class UniqueLock(TypedDict):
    key: str  # the lock's key: the job's name and the hash of its unique arguments
    mode: str  # "until_started" or "until_finished"
    held: bool  # this job holds the lock now (else another job or nobody does)
    holder: str | None  # the task id that holds it now, None when nobody does
    ttl: float | None  # seconds until the lock's safety-net TTL ends it


class JobStatus(TypedDict):
    job_id: str
    # queued, scheduled, retrying, reserved, running, succeeded, failed, dead, revoked, finished
    state: str
    done: bool
    job_name: str | None
    progress: float | None  # 0..1 from the last checkin
    message: str | None  # message of the last checkin
    checkin_at: float | None
    started_at: float | None
    due_at: float | None  # scheduled / retrying: when it is due (Redis-clock seconds)
    finished_at: float | None
    result: str | None  # repr of the return value (succeeded), cut
    error: str | None  # "ExcType: message" (failed, dead, retrying)
    dead_id: str | None  # id in the dead set (dead)
    stop_requested: bool
    queue: str | None  # the job queue it is in or was fetched from (by the job index)
    level: int | None  # queued: its priority level in that queue
    pool: str | None  # reserved / running / finished: the worker pool (by the job index)
    indexed: bool  # found in the job index (else searched for in the sets)
    cursor: Any  # a resumable job's cursor (decoded JSON), None when it keeps none
    # A unique job's lock, where its message is kept in a record (scheduled, retrying,
    # reserved or running, dead): None for a job that is not unique or not found there
    unique_lock: UniqueLock | None
