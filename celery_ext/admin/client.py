"""The read/admin API of celery_ext: the one object the dashboard and the CLI use.

    from celery_ext.client import Client
    client = Client.from_app(app)              # or Client.from_url("celery-ext://...")
    client.dead(limit=20, name="tasks.flaky")  # newest first
    client.retry_dead(job_id)                  # back to the front of its job queue
    client.pause("tasks.report")

A facade, one method per thing a person reads or does: job queues, worker pools and
busy workers come from the read model (:mod:`celery_ext.admin.overview`); the
scheduled, retry and dead sets from :mod:`celery_ext.admin.job_sets`, and search in
them from :mod:`celery_ext.admin.search`; one job's status from
:mod:`celery_ext.admin.job_status`; the shapes it returns are in
:mod:`celery_ext.admin.api_types`. This module itself steers job queues: pause and
resume, concurrency and rate limits. Every write is one script or one MULTI, and
idempotent: two people pressing "retry" on the same dead job requeue it once. Times are
seconds on the Redis clock. It works alike on one node, behind Sentinel and on a
Cluster: :meth:`Client.from_app` takes the connection the app's broker transport
builds for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from celery_ext.admin.api_types import (
    BusyWorker,
    DeadJob,
    JobStatus,
    Page,
    PendingChord,
    PoolInfo,
    QueueInfo,
    Runtime,
    ScheduledJob,
    SearchPage,
    Series,
    SetCounts,
)
from celery_ext.admin.job_sets import JobSets
from celery_ext.admin.job_status import JobLookup
from celery_ext.admin.overview import State
from celery_ext.admin.periodic_entries import (
    PeriodicEntry,
    entry_rows,
    remove_entry,
    run_now,
    set_entry,
    set_paused,
)
from celery_ext.admin.search import Filters, SetSearch, parse_cursor, search_sets
from celery_ext.config import Settings
from celery_ext.options.rate_limits import format_rate, interval_us
from celery_ext.store.clock import now_s
from celery_ext.store.connections import client_from_url
from celery_ext.store.copies import copies, per_copy, set_counts
from celery_ext.store.history import HistoryReader
from celery_ext.store.keys import Keys
from celery_ext.store.memory import eviction_warning
from celery_ext.store.revoked import RevokedId, RevokeOutcome, revoke, revoked, sender
from celery_ext.store.runtime_schedules import InvalidPeriodicEntry
from celery_ext.store.scripts import Scripts
from celery_ext.worker.control import mark_revoked
from celery_ext.worker.reaper import Reaper, ReapResult

__all__ = ["Client", "DeadJob", "InvalidPeriodicEntry", "Page", "ScheduledJob", "SetCounts"]


class Client:
    """Reads and steers one namespace of a celery_ext Redis."""

    #: The Celery app, when built with :meth:`from_app`: :meth:`job` reads finished jobs
    #: from its result backend, :meth:`run_periodic_now` its ``beat_schedule``.
    app: Any = None

    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        # redis-py types replies as sync/async unions; this is the sync client.
        self.client: Any = client
        self.settings = settings or Settings()
        self.keys = Keys.for_settings(self.settings)
        self.scripts = Scripts(client)
        self.state = State(client, self.settings)
        self.sets = JobSets(client, self.settings, self.scripts)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Client:
        """Connect to a ``celery-ext://`` (or ``redis://``, or ``celery-ext+sentinel://``)
        URL; ``options`` are the transport options (``namespace=...``, ``master_name=...``,
        ``cluster=True``), overridden by ``CELERY_EXT_*``."""
        return cls(client_from_url(url, options), Settings.load(options))

    @classmethod
    def from_app(cls, app: Any) -> Client:
        """Connect like ``app``'s broker does (URL, TLS, Sentinel or Cluster, transport
        options), keeping ``app`` for :meth:`job` and :meth:`run_periodic_now`. Fails
        within seconds (one connection attempt) when Redis is down."""
        with app.connection_for_write() as conn:
            channel = conn.channel()
            try:
                if not hasattr(channel, "new_client"):
                    raise ValueError(f"celery_ext: {app.main!r} does not use the celery-ext:// "
                                     "broker transport")
                client = cls(channel.new_client(), channel.settings)
            finally:
                channel.close()
        client.app = app
        return client

    @classmethod
    def for_app(cls, app: Any) -> Client:
        """The same as :meth:`from_app` (the name the CLI and older code use)."""
        return cls.from_app(app)

    # -- queues, pools, busy workers (celery_ext.admin.overview) -------------------------
    def job_queues(self, offset: int = 0, limit: int | None = None,
                   prefix: str | None = None) -> list[QueueInfo]:
        return self.state.job_queues(offset, limit, prefix)

    def worker_pools(self) -> list[PoolInfo]:
        return self.state.worker_pools()

    def busy_workers(self) -> list[BusyWorker]:
        return self.state.busy_workers()

    def request_stop(self, job_id: str) -> bool:
        """Ask a running job to stop: its next checkin returns True. False (nothing
        kept) when the job is not in flight (see :mod:`celery_ext.store.stop_requests`)."""
        return self.state.request_stop(job_id)

    def cancel(self, job_id: str, by: str | None = None) -> RevokeOutcome:
        """Cancel a job by its id, wherever it is, as Celery's ``revoke(terminate=True)``
        does here: queued, scheduled or in the retry set, it moves to the dead set now
        (reason ``revoked``; a queued job deep in a long queue or under a fair key when
        its fetch pops it); in flight, its next
        checkin says stop; enqueued later with this id, it does not run either (for
        ``revoked_ttl``). ``by``: who, for the record (default this host and pid). Built
        with :meth:`from_app`, the job's result says ``REVOKED`` too, as Celery's revoke
        makes it. See :mod:`celery_ext.store.revoked`."""
        outcome = revoke(self.client, self.scripts, self.settings, [job_id],
                         by=by or sender(), via="cancel", terminate=True)
        if self.app is not None:
            mark_revoked([job_id], self.app.backend)
        return outcome

    def revoked(self) -> list[RevokedId]:
        """The revokes that hold now, oldest first, with who made them and when."""
        return revoked(self.client, self.keys)

    def totals(self) -> dict[str, int]:
        """Processed/failed/retried counters over all job queues."""
        return self.state.totals()

    def queue_count(self, prefix: str | None = None) -> int:
        """How many job queues (whose name starts with ``prefix``) exist."""
        return sum(1 for n in self.state.queue_names() if not prefix or n.startswith(prefix))

    def counts(self) -> SetCounts:
        """Sizes of the scheduled, retry and dead sets (summed over the copies)."""
        scheduled, retry, dead = set_counts(self.client, self.keys)
        return SetCounts(scheduled=int(scheduled), retry=int(retry), dead=int(dead))

    # -- pause, resume, limits -----------------------------------------------------------
    def pause(self, queue: str) -> bool:
        """Stop fetching from a job queue; its jobs stay. False if already paused."""
        return bool(self.client.sadd(self.keys.of(queue).paused, queue))

    def resume(self, queue: str) -> bool:
        """Fetch from a paused job queue again (idle pools are woken). False if it
        was not paused."""
        removed, = self._steer(queue, lambda pipe, k: pipe.srem(k.paused, queue))
        return bool(removed)

    def paused(self) -> list[str]:
        return sorted({bytes_to_str(q) for (names,) in self._each(lambda p, k: p.smembers(k.paused))
                       for q in names})

    def set_max_concurrency(self, queue: str, limit: int | None) -> None:
        """Cap (or, with None, uncap) how many jobs of a queue run at once in all
        pools. Worker pools rewrite the limits of their queues from task options when
        they start, so this lasts until the next pool starts."""
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_concurrency must be a whole number >= 1, got {limit!r}")
        self._steer(queue, lambda pipe, k: pipe.hdel(k.limits, queue) if limit is None
                    else pipe.hset(k.limits, queue, limit))

    def limits(self) -> dict[str, int]:
        # (Fields "<queue>\n" are per-fair-key limits, fair.py: not a queue's.)
        return {bytes_to_str(q): int(n) for (found,) in self._each(lambda p, k: p.hgetall(k.limits))
                for q, n in found.items() if not q.endswith(b"\n")}

    def set_rate_limit(self, queue: str, limit: str | None) -> str | None:
        """Limit (or, with None, unlimit) how often jobs of a queue start, in all pools:
        a Celery rate like ``"20/s"``, ``"10/m"``, ``"5/h"``. The queue's next job is
        due at once. Worker pools rewrite the limits of their queues from task options
        when they start, so this lasts until the next pool starts. Returns the limit
        as stored (``"20/s"``), or None. Raises ValueError for anything not a rate."""
        interval = interval_us(limit) if limit is not None else None
        self._steer(queue, lambda pipe, k: (
            pipe.hdel(k.rate_limits, queue) if interval is None
            else pipe.hset(k.rate_limits, queue, interval), pipe.hdel(k.rate_tat, queue)))
        return format_rate(interval) if interval is not None else None

    def rate_limits(self) -> dict[str, str]:
        """Job queue -> its cluster-wide rate limit (``"20/s"``); per-key rate limits
        (``fair_rate_limit``) are in each queue's ``fair`` (:meth:`job_queues`)."""
        return {bytes_to_str(q): format_rate(int(n))
                for (found,) in self._each(lambda p, k: p.hgetall(k.rate_limits))
                for q, n in found.items() if not q.endswith(b"\n")}

    def _each(self, read: Callable[[Any, Keys], object]) -> list[list[Any]]:
        """``read(pipe, copy)`` for every copy of the namespace (one on one node), one
        pipeline: each copy's replies."""
        return per_copy(self.client, copies(self.client, self.keys), read)

    def _steer(self, queue: str, write: Callable[[Any, Keys], object]) -> list[Any]:
        """``write(pipe, copy)`` in the copy holding ``queue``, as one MULTI, then wake
        idle pools for it: the PUBLISH is part of the MULTI on one node; a cluster's
        pipeline cannot carry one, so it follows the MULTI there. The write's replies."""
        cluster = self.keys.cluster
        with self.client.pipeline(transaction=True) as pipe:
            write(pipe, self.keys.of(queue))
            if not cluster:
                pipe.publish(self.keys.wake_channel, queue)
            replies = pipe.execute()
        if cluster:
            self.client.publish(self.keys.wake_channel, queue)
            return list(replies)
        return list(replies[:-1])

    # -- scheduled and retry sets (celery_ext.admin.job_sets) ----------------------------
    def scheduled(self, offset: int = 0, limit: int = 50,
                  name: str | None = None) -> Page[ScheduledJob]:
        """Jobs waiting for their countdown/eta, soonest first."""
        return self.sets.scheduled(offset, limit, name)

    def retries(self, offset: int = 0, limit: int = 50,
                name: str | None = None) -> Page[ScheduledJob]:
        """The retry set: failed jobs waiting for their next attempt, soonest first,
        with attempt number, last error and next run time (``due_at``)."""
        return self.sets.retries(offset, limit, name)

    def run_scheduled_now(self, job_id: str) -> bool:
        """Make a scheduled job or retry due now (promoted within moments)."""
        return job_id in self.sets.run_now([job_id])

    def delete_scheduled(self, job_id: str) -> bool:
        """Drop a job from the scheduled or retry set (it will not run); a unique job's
        lock is released with it, so an identical job can be enqueued at once."""
        return job_id in self.sets.forget("scheduled", [job_id])

    # -- dead set ------------------------------------------------------------------------
    def dead(self, offset: int = 0, limit: int = 50, name: str | None = None) -> Page[DeadJob]:
        """Dead jobs, newest first, optionally only those of one job name."""
        return self.sets.dead(offset, limit, name)

    def dead_job(self, job_id: str) -> DeadJob | None:
        """One dead job with its raw message, or None if it is not (or no longer) dead."""
        return self.sets.dead_job(job_id)

    def retry_dead(self, job_id: str) -> bool:
        """Move one dead job to the front of its job queue, attempts reset and marked
        as a manual retry. False if it was not dead (e.g. already retried)."""
        return job_id in self.sets.retry_dead_ids([job_id])

    def retry_all_dead(self, name: str | None = None) -> int:
        """Retry every dead job (of one job name); returns how many were requeued."""
        return self.sets.retry_all_dead(name)

    def delete_dead(self, job_id: str) -> bool:
        """Forget one dead job (releasing its unique lock, if it still holds one).
        False if it was not dead."""
        return job_id in self.sets.forget("dead", [job_id])

    def delete_all_dead(self, name: str | None = None) -> int:
        """Forget every dead job (of one job name), releasing the unique locks they
        still hold; returns how many."""
        return self.sets.delete_all_dead(name)

    # -- search in the sets (celery_ext.admin.search) ------------------------------------
    def search(self, kind: str, filters: Filters, cursor: str | None = None,
               limit: int = 50) -> SearchPage:
        """Jobs of the ``kind`` set ("dead", "scheduled", "retry") that match, from
        ``cursor`` (None: the start); the page's ``cursor`` goes on (None: no more)."""
        matches, nxt, scanned = search_sets(self.client, self.scripts, self.keys, kind,
                                            filters, parse_cursor(cursor), limit)
        return SearchPage(items=self.sets.built(kind, matches), cursor=nxt, scanned=scanned)

    def count_matching(self, kind: str, filters: Filters) -> int:
        """How many jobs of the ``kind`` set match (scans the set in chunks)."""
        return sum(SetSearch(self.client, self.scripts, k, kind).count(filters)
                   for k in copies(self.client, self.keys))

    def retry_matching(self, kind: str, filters: Filters) -> int:
        """Retry every matching dead job (as :meth:`retry_dead`), or make every matching
        scheduled job or retry due now; returns how many."""
        action = self.sets.retry_dead_ids if kind == "dead" else self.sets.run_now
        return sum(SetSearch(self.client, self.scripts, k, kind).act(filters, action)
                   for k in copies(self.client, self.keys))

    def delete_matching(self, kind: str, filters: Filters) -> int:
        """Delete every matching job of the ``kind`` set; returns how many."""
        return sum(SetSearch(self.client, self.scripts, k, kind).act(
            filters, lambda ids: self.sets.forget(kind, ids))
            for k in copies(self.client, self.keys))

    # -- the server, one job, the reaper -------------------------------------------------
    def ping(self) -> bool:
        return bool(self.client.ping())

    def server_time(self) -> float:
        """Redis server time, seconds."""
        return now_s(self.client)

    def memory_warning(self) -> str | None:
        """Why the server's ``maxmemory-policy`` can lose jobs, or None (``noeviction``,
        or INFO refused)."""
        try:
            return eviction_warning(self.client)
        except redis.ResponseError:
            return None

    def job(self, job_id: str, deep: bool = True) -> JobStatus:
        """One job's status by its id (see :mod:`celery_ext.admin.job_status`)."""
        return JobLookup(self.client, self.settings, self.app, self.scripts).status(job_id,
                                                                                    deep)

    def pending_chords(self, limit: int = 100) -> list[PendingChord]:
        """Chords whose body was not sent yet, oldest first, with their progress (n of m
        header results): read from the app's result backend when it is celery-ext's
        (:meth:`from_app`); empty otherwise."""
        read = getattr(getattr(self.app, "backend", None), "pending_chords", None)
        if read is None:
            return []
        return [PendingChord(group_id=r["group_id"], counted=r["counted"], size=r["size"],
                             applied_at=r["applied_at"]) for r in read(limit)]

    def reap(self, force: bool = False) -> ReapResult:
        """One reaper pass now: requeue the jobs of dead worker pools, each judged by
        its own ``dead_after``. Pools that look dead are first watched for two of their
        heartbeat intervals (and a second) of steady Redis, so a Redis outage or stall
        does not pass for their death; ``force=True`` skips that (see
        :meth:`celery_ext.worker.reaper.Reaper.reap_now`)."""
        return Reaper(self.client, self.settings).reap_now(force=force)

    # -- periodic jobs (admin/periodic_entries.py) -----------------------------------
    def periodic(self) -> list[PeriodicEntry]:
        """Every periodic job entry: schedule, next and last run, last outcome, paused,
        and its source ("config": the app's ``beat_schedule``; "runtime": set here)."""
        return entry_rows(self.client, self.keys, self.app)

    def set_periodic(self, name: str, task: str, every: float | None = None,
                     crontab: str | None = None, args: Any = (), kwargs: Any = None,
                     options: Any = None) -> bool:
        """Create or replace the periodic job entry ``name`` at runtime, stored in Redis
        (it outlives every pool, and wins over the app's ``beat_schedule`` entry of the
        same name): ``task`` run ``every`` seconds (at least 1) or on ``crontab`` (five
        fields, "m h dom mon dow"), exactly one of the two, with ``args``, ``kwargs`` and
        Celery's publish ``options`` (``{"queue": ...}``). With the app
        (:meth:`from_app`) the task must be one it registers; without, a dotted name.
        Returns True when the entry is new. Raises :class:`InvalidPeriodicEntry` (a
        ``ValueError``) for bad input, storing nothing."""
        return set_entry(self.client, self.keys, name, task, every, crontab, args, kwargs,
                         options, self.app)

    def remove_periodic(self, name: str) -> bool:
        """Remove the runtime entry ``name`` (the app's entry of that name, if any, runs
        again); False when no runtime entry has that name."""
        return remove_entry(self.client, self.keys, name)

    def pause_periodic(self, name: str) -> bool | None:
        """Pause an entry (its due times pass without runs); None if there is none."""
        return set_paused(self.client, self.keys, name, True)

    def resume_periodic(self, name: str) -> bool | None:
        """Resume a paused entry from its next due time; None if there is none."""
        return set_paused(self.client, self.keys, name, False)

    def run_periodic_now(self, name: str) -> str | None:
        """Enqueue one run of an entry now (needs the app: :meth:`from_app`); its job id,
        or None when neither the runtime entries nor the app's ``beat_schedule`` have it."""
        if self.app is None:
            raise ValueError("celery_ext: run-now needs the Celery app (Client.from_app)")
        return run_now(self.app, self.client, self.keys, name)

    # -- history (celery_ext.store.history) ----------------------------------------------
    def history(self, window: str = "1h") -> Series:
        """Per-minute (per-hour for the long windows) counts, runtime percentiles and
        queue sizes over ``window`` ("1h", "6h", "24h", "7d", "30d")."""
        return HistoryReader(self.client, self.settings).series(window, self.server_time())

    def runtimes(self, window: str = "1h") -> list[Runtime]:
        """Per job name: counts and runtime p50/p95/p99 over ``window``."""
        return HistoryReader(self.client, self.settings).runtimes(window, self.server_time())
