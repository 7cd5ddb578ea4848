"""Busy workers and checkin: what each execution slot runs now, and long-job progress.

Written from the process that runs the job (a prefork child, a thread, the solo
worker), through Celery's ``task_prerun``/``task_postrun`` signals. ``checkin()``
records progress at most once per ``CHECKIN_MIN_INTERVAL`` per job and tells the job
whether to stop: its pool is shutting down, or someone asked through the client API.

A process killed mid-job (a prefork child's SIGKILL, OOM) cannot clear its records:
the pool's main process does it when Celery reports the loss (:func:`job_lost`). A
pool killed whole leaves them to the reaper, which drops the checkins of the jobs in
the pool's busy hash: so a job's first checkin writes its busy record with it.

Redis out of reach never ends a job here (stock Celery has no checkin): a checkin
answers from what it last heard and writes later, a busy record's clearing waits in
memory for the background thread, and the outage is logged once, and its end once.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from typing import Any

from billiard.exceptions import WorkerLostError
from celery import current_task
from celery.signals import task_failure, task_postrun, task_prerun, worker_process_shutdown
from redis.cluster import RedisCluster

from celery_ext.config import OBSERVER_RETRY_INTERVAL, Settings, uses_our_transport
from celery_ext.errors import CONNECTION_ERRORS
from celery_ext.store.connections import green_sockets
from celery_ext.store.history import HistoryWriter
from celery_ext.store.keys import RUNTIME_BUCKET_NAMES, RUNTIME_BUCKETS, Keys
from celery_ext.store.scripts import Scripts
from celery_ext.text import one_line
from celery_ext.worker import cursor as cursors
from celery_ext.worker.flush_timer import FlushTimer
from celery_ext.worker.heartbeater import owning_pool_id
from celery_ext.worker.outage import Outage
from celery_ext.worker.running_job import RunningJob, slot_id
from celery_ext.worker.wait_times import wait_fields

logger = logging.getLogger("celery_ext.worker.observer")

#: A job writes its checkin to Redis at most this often (seconds), however often it calls.
CHECKIN_MIN_INTERVAL = 1.0
#: A job's busy record is written only once it has run this long (seconds): short
#: jobs cost no round trip from the executing process, while the long jobs the busy
#: view is for still show (a record per job costs more than a short job itself).
BUSY_RECORD_DELAY = 0.1
#: Under gevent, a finished job's busy record is cleared by the background greenlet
#: within this many seconds, with the others due, in one round trip (not one per job).
GREEN_END_DELAY = 0.05


def runtime_bucket(seconds: float) -> str:
    """The ``{ns}:runtime`` field prefix of a run this long (bounds are inclusive, as
    Prometheus' ``le``)."""
    return RUNTIME_BUCKET_NAMES[bisect.bisect_left(RUNTIME_BUCKETS, seconds)]

_observers: dict[int, Observer] = {}
_observers_lock = threading.Lock()


class _CheckinState:
    __slots__ = ("answer", "last_write", "pending")

    def __init__(self) -> None:
        self.last_write = 0.0
        self.answer = False
        self.pending: dict[str, Any] | None = None


class Observer:
    """Records this process's running jobs for its pool (one per process and app).

    A background thread writes the busy record of a job once it has run
    ``BUSY_RECORD_DELAY`` and flushes the counters when due (``flush_timer.py``);
    ``flush()`` is the one-shot step (also run at process shutdown)."""

    def __init__(self, client: Any, settings: Settings, pool_id: str,
                 clock_offset: float = 0.0) -> None:
        self.client = client
        #: Redis time minus this host's (read with TIME by the channel the observer's
        #: client comes from): a job's wait is measured on the clock that stamped it.
        self.clock_offset = clock_offset
        self.settings = settings
        self.pool_id = pool_id
        self.keys = Keys.for_settings(settings)
        self.scripts = Scripts(client)
        self.history = HistoryWriter(client, settings)  # per-minute counts, with the stats
        self._checkins: dict[str, _CheckinState] = {}
        self._running: dict[str, RunningJob] = {}
        #: The running jobs whose busy record is not written yet, oldest first (in start
        #: order): ``flush`` looks at the oldest only, not at every job running.
        self._unwritten: dict[str, RunningJob] = {}
        self._stats: dict[str, int] = {}
        #: {ns}:runtime fields (runtimes at a job's end, waits at its start), written with
        #: the stats.
        self._runtime: dict[str, int] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: The background thread is started and has not ended (``_ensure_thread``).
        self._thread_running = False
        self._stopped = False
        #: When the background thread will look again on its own (monotonic; None:
        #: not before it is woken). Jobs wake it only when they need it sooner: two
        #: thread switches per job are a large share of a short job's cost.
        self._sleep_until: float | None = None
        self._flush_timer = FlushTimer()
        #: Jobs are greenlets of this process (``-P gevent``): their busy records are
        #: cleared by ``flush`` (``GREEN_END_DELAY``), not by each job.
        self._green = green_sockets()
        #: Finished jobs whose records ``flush`` clears: (job id, slot, when it finished),
        #: in finish order.
        self._ends: list[tuple[str, str, float]] = []
        self._outage = Outage(
            logger, "busy records, checkins and counters wait in memory until it is back",
            "busy records and checkins written again")

    @classmethod
    def for_app(cls, app: Any) -> Observer | None:
        """The observer of this process, or None when the broker is not ours."""
        key = id(app)
        obs = _observers.get(key)  # each job asks: the lock only when one is made
        if obs is not None:
            return obs
        with _observers_lock:
            obs = _observers.get(key)
            if obs is None:
                conn = app.connection_for_write()
                channel = conn.default_channel
                if not hasattr(channel, "new_client"):
                    return None
                obs = _observers[key] = cls(channel.new_client(), channel.settings,
                                            owning_pool_id(),
                                            getattr(channel, "_clock_offset", 0.0))
            return obs

    def _busy(self, mode: str, job_id: str, slot: str, record: str = "",
              elapsed_ms: int = 0, client: Any = None) -> None:
        self.scripts("busy", [self.keys.busy(self.pool_id), self.keys.checkins,
                              self.keys.stop_requests, self.keys.stats],
                     [slot, mode, job_id, record, "", "", elapsed_ms], client=client)

    def _write_busy(self, ends: list[tuple[str, str, float]],
                    starts: list[tuple[RunningJob, int]]) -> None:
        """Clear the records of ``ends``, then write those of ``starts`` (a slot's next
        job starts after its last one ended): one round trip for all, pipelined, on one
        node; one call each on a cluster, whose pipelines do not send scripts."""
        calls = [("end", job_id, slot, "", 0) for job_id, slot, _ in ends]
        calls += [("start", r.job_id, r.slot, r.record, age_ms) for r, age_ms in starts]
        if len(calls) == 1 or isinstance(self.client, RedisCluster):
            for call in calls:
                self._busy(*call)
            return
        with self.client.pipeline(transaction=False) as pipe:
            for call in calls:
                self._busy(*call, client=pipe)
            pipe.execute()

    def job_started(self, task: Any, job_id: str, args: Any, kwargs: Any,
                    waited: list[tuple[str, int]] | None = None) -> None:
        """``waited``: the job's wait-time fields (``wait_times.wait_fields``)."""
        running = RunningJob(job_id, task, args, kwargs, slot_id())
        with self._lock:
            self._running[job_id] = running
            self._unwritten[job_id] = running
            for field, amount in waited or ():  # written with the next counter flush
                self._runtime[field] = self._runtime.get(field, 0) + amount
            if waited:
                self._flush_timer.counted(self.clock_offset)
            sleeping = self._sleep_until
        self._ensure_thread()
        if sleeping is None or sleeping > running.started + BUSY_RECORD_DELAY:
            self._wake.set()

    def job_finished(self, job_id: str, queue: str = "", outcome: str = "",
                     name: str = "") -> None:
        checked_in = self._checkins.pop(job_id, None) is not None
        with self._lock:
            running = self._running.pop(job_id, None)
            self._unwritten.pop(job_id, None)
            if outcome:
                for field in (outcome, f"{outcome}:{queue}"):
                    self._stats[field] = self._stats.get(field, 0) + 1
                self._flush_timer.counted(self.clock_offset, 1, outcome == "failed")
                seconds = (time.monotonic() - running.started) if running is not None else None
                self.history.add(name or queue, outcome, seconds)
                if seconds is not None:
                    for field, amount in ((f"{runtime_bucket(seconds)}:{queue}", 1),
                                          (f"sum_us:{queue}", int(seconds * 1e6))):
                        self._runtime[field] = self._runtime.get(field, 0) + amount
            if (running is not None and running.written) or checked_in:
                # The record (or a checkin) is in Redis: clear it with the job.
                slot = running.slot if running else slot_id()
                if not self._green and not self._outage.waiting():
                    try:
                        self._busy("end", job_id, slot)
                    except CONNECTION_ERRORS as exc:
                        self._outage.failed(exc)
                    else:
                        self._outage.ok()
                        return
                # Under gevent, or Redis out of reach: the background thread clears it
                # (before it writes the record of the slot's next job).
                now = time.monotonic()
                self._ends.append((job_id, slot, now))
                sleeping = self._sleep_until
                wake = sleeping is None or sleeping > now + GREEN_END_DELAY
            else:
                wake = False
        if wake:
            self._wake.set()

    def wake_for_stats(self) -> None:
        """After a job ended: make sure its counters are written when due."""
        with self._lock:
            sleeping = self._sleep_until
            due = self._stats_due()
        if due is not None and (sleeping is None or sleeping > due):
            self._wake.set()

    def _stats_due(self) -> float | None:
        """When (monotonic) the counters summed here are due to be written (None: none
        wait; the caller holds the lock)."""
        return self._flush_timer.due() if self._stats or self._runtime else None

    def flush(self, force_stats: bool = False, _plan: bool = False) -> float:
        """Write busy records of jobs running past the delay and, when due, the
        counters. Returns seconds until something is due (1e9: nothing pending)."""
        now = time.monotonic()
        wait = 1e9
        with self._lock:
            starts: list[tuple[RunningJob, int]] = []
            for running in self._unwritten.values():
                age = now - running.started
                if age < BUSY_RECORD_DELAY:  # (and every later one)
                    wait = min(wait, BUSY_RECORD_DELAY - age)
                    break
                starts.append((running, int(age * 1000)))
            ends_due = bool(self._ends) and (
                force_stats or bool(starts) or now - self._ends[0][2] >= GREEN_END_DELAY)
            if self._ends and not ends_due:
                wait = min(wait, GREEN_END_DELAY - (now - self._ends[0][2]))
            if starts or ends_due:
                ends, self._ends = (self._ends, []) if ends_due else ([], self._ends)
                try:
                    self._write_busy(ends, starts)
                except BaseException:
                    self._ends[:0] = ends  # (written again by the next flush)
                    raise
                for running, _ in starts:
                    running.written = True
                    del self._unwritten[running.job_id]
                self._outage.ok()
            due = self._stats_due()
            stats_due = due is not None and (force_stats or now >= due)
            if stats_due:
                stats, self._stats = self._stats, {}
                runtime, self._runtime = self._runtime, {}
                pending = self._flush_timer.taken(now)
        if stats_due:
            self._write_stats(stats, runtime, pending)
        with self._lock:
            later = time.monotonic()
            if wait < 1e9:  # (less the time the counters took to write)
                wait -= later - now
            due = self._stats_due()
            if due is not None:
                wait = min(wait, due - later)
            wait = max(wait, 0.005)
            if _plan:  # the thread sleeps this long; decided under the lock job_started takes
                self._sleep_until = None if wait >= 1e9 else later + wait
        return wait

    def _write_stats(self, stats: dict[str, int], runtime: dict[str, int],
                     pending: tuple[int, bool, float | None]) -> None:
        """Write a flush's counters, runtime fields and history, in one script call
        (``HistoryWriter.flush``), outside the lock every job's start and end take: at
        10,000 job names a flush carries a field per name that ran, and its round trip
        (tens of ms) held up every job slot. ``pending``: what made it due, restored
        with the counts when the write fails."""
        # With the known queues: a queue forgotten since its jobs ran is added back, so its
        # fields are forgotten again (queue_info.lua); the runtime fields are its queues'.
        try:
            self.history.flush(stats, runtime)
        except BaseException:  # not written: counted again with the next flush
            with self._lock:
                self._merge(stats, runtime, pending)
            raise
        with self._lock:
            self._outage.ok()

    def _merge(self, stats: dict[str, int], runtime: dict[str, int],
               pending: tuple[int, bool, float | None]) -> None:
        """Counts a flush could not write go back to be written by the next (the
        caller holds the lock)."""
        for into, counts in ((self._stats, stats), (self._runtime, runtime)):
            for field, amount in counts.items():
                into[field] = into.get(field, 0) + amount
        self._flush_timer.restore(pending)

    def _ensure_thread(self) -> None:
        """Start the background thread unless it runs (a flag, not ``is_alive()``: each
        job asks, and under gevent that call was 2 % of a worker's CPU)."""
        if self._thread_running or self._stopped:
            return
        with self._lock:
            if self._thread_running or self._stopped:
                return
            self._thread_running = True
        self._thread = threading.Thread(target=self._run, name="celery_ext-observer",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is pending, end the background thread and close the connection
        (the worker pool stops: an embedded test worker's process goes on running)."""
        self._stopped = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        try:
            self.flush(force_stats=True)
        finally:
            self.client.close()

    def _run(self) -> None:
        try:
            while not self._stopped:
                if self._outage.waiting():  # Redis was out of reach a moment ago
                    self._wake.wait(max(self._outage.next_try - time.monotonic(), 0.005))
                    self._wake.clear()
                    continue
                try:
                    wait = self.flush(_plan=True)
                except CONNECTION_ERRORS as exc:
                    self._outage.failed(exc)  # said once per outage, tried again later
                    wait = OBSERVER_RETRY_INTERVAL
                    with self._lock:
                        self._sleep_until = time.monotonic() + wait
                except Exception as exc:
                    logger.warning("celery_ext: could not write busy records: %s", exc)
                    wait = OBSERVER_RETRY_INTERVAL
                    with self._lock:
                        self._sleep_until = time.monotonic() + wait

                self._wake.wait(None if wait >= 1e9 else wait)
                self._wake.clear()
        finally:
            self._thread_running = False

    def checkin(self, job_id: str, message: str | None = None,
                progress: float | None = None) -> tuple[bool, bool]:
        """Record progress (throttled). Returns (should stop, written now).

        Redis out of reach does not raise: the answer is the last one heard, and the
        latest progress is written by a later call (or dropped if the job ends first)."""
        state = self._checkins.get(job_id)
        if state is None:
            state = self._checkins[job_id] = _CheckinState()
        state.pending = {"message": message, "progress": progress}
        now = time.monotonic()
        if state.last_write and now - state.last_write < CHECKIN_MIN_INTERVAL:
            return state.answer, False
        if self._outage.waiting():
            return state.answer, False
        call = ("checkin",
                [self.keys.checkins, self.keys.stop_requests, self.keys.pool(self.pool_id)],
                [job_id, json.dumps(state.pending, default=repr, separators=(",", ":"))])
        try:
            stop, pool_state, _ = self._write_checkin(job_id, call)
        except CONNECTION_ERRORS as exc:
            self._outage.failed(exc)
            state.last_write = now  # tried: the next call an interval later tries again
            return state.answer, False
        self._outage.ok()
        state.last_write = now
        state.pending = None
        state.answer = bool(stop) or (pool_state or b"") in (b"stopping", "stopping")
        return state.answer, True


    def _write_checkin(self, job_id: str, call: tuple[str, list[str], list[Any]]) -> Any:
        """Run the checkin script; the job's busy record goes with it if it is not
        written yet (the job checks in before ``BUSY_RECORD_DELAY``). A checkin is then
        never in Redis without the busy record through which the reaper drops it when
        the whole pool dies. The ends still to clear go first, as in ``flush``: one may
        be the previous job of this slot. Returns the checkin script's reply."""
        with self._lock:
            running = self._unwritten.pop(job_id, None)
            if running is None:
                return self.scripts(*call)
            ends, self._ends = self._ends, []
            busy: list[tuple[str, str, str, str, int]] = [
                ("end", job, slot, "", 0) for job, slot, _ in ends]
            busy.append(("start", job_id, running.slot, running.record,
                         int((time.monotonic() - running.started) * 1000)))
            try:
                if isinstance(self.client, RedisCluster):  # no scripts in its pipelines
                    for one in busy:
                        self._busy(*one)
                    reply = self.scripts(*call)
                else:
                    with self.client.pipeline(transaction=False) as pipe:
                        for one in busy:
                            self._busy(*one, client=pipe)
                        self.scripts(*call, client=pipe)
                        reply = pipe.execute()[-1]
            except BaseException:
                self._ends[:0] = ends
                self._unwritten[job_id] = running
                self._unwritten = dict(sorted(self._unwritten.items(),
                                              key=lambda item: item[1].started))
                raise
            running.written = True
            return reply


def checkin(message: str | None = None, progress: float | None = None,
            task: Any = None, cursor: Any = cursors.UNSET) -> bool:
    """Report progress of the running job; True means "stop now, cleanly".

    True when the job's worker pool is shutting down (warm shutdown) or someone asked
    this job to stop (``celery_ext.client``). Writes at most once per second per job,
    however often it is called; also emits a ``task-progress`` Celery event (Flower).
    ``cursor``: where a resumable job is, its next run's ``self.cursor`` (cursor.py).
    """
    task = task or current_task
    if task is None or task.request.id is None or task.request.called_directly:
        return False
    obs = Observer.for_app(task.app)
    if obs is None:
        return False
    answer, written = obs.checkin(task.request.id, message, progress)
    if cursor is not cursors.UNSET:
        cursors.save(obs, task, cursor, stopping=answer)
    if written:
        try:
            task.send_event("task-progress", message=message, progress=progress)
        except Exception:  # events are best effort; the Redis record is the truth
            logger.debug("celery_ext: could not send task-progress event", exc_info=True)
    return answer


def _task_checkin(self: Any, message: str | None = None, progress: float | None = None,
                  cursor: Any = cursors.UNSET) -> bool:
    return checkin(message, progress, task=self, cursor=cursor)


def _observed(app: Any) -> bool:
    """Busy records and counters are kept for the apps whose broker is ours, with or
    without ``install(app)`` (decided once per app: this runs for every job)."""
    ours = app.__dict__.get("_celery_ext_observed")
    if ours is None:
        ours = app.__dict__["_celery_ext_observed"] = (
            getattr(app, "_celery_ext_installed", False) or uses_our_transport(app.conf))
    return bool(ours)


def _job_queue(task: Any) -> str:
    """The job queue of the running job, as its counters name it."""
    return (task.request.delivery_info or {}).get("routing_key") or task.name


@task_prerun.connect(weak=False)
def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None,
               args: Any = None, kwargs: Any = None, **kw: Any) -> None:
    if task is None or task_id is None or not _observed(task.app):
        return
    try:
        obs = Observer.for_app(task.app)
        if obs is not None:
            waited = wait_fields(task.request, _job_queue(task), obs.clock_offset)
            obs.job_started(task, task_id, args, kwargs, waited)
    except Exception as exc:
        logger.warning("celery_ext: could not record busy worker for %s: %s",
                       one_line(task_id), exc)


#: Celery end state of a run -> the stats counter it increments.
OUTCOMES = {"SUCCESS": "processed", "FAILURE": "failed", "RETRY": "retried"}


@task_postrun.connect(weak=False)
def _on_postrun(sender: Any = None, task_id: str | None = None, task: Any = None,
                state: str | None = None, **kw: Any) -> None:
    if task is None or task_id is None or not _observed(task.app):
        return
    try:
        obs = Observer.for_app(task.app)
        if obs is not None:
            obs.job_finished(task_id, queue=_job_queue(task), outcome=OUTCOMES.get(state or "", ""),
                             name=task.name)
            obs.wake_for_stats()
    except Exception as exc:
        logger.warning("celery_ext: could not clear busy worker for %s: %s",
                       one_line(task_id), exc)


def job_lost(app: Any, job_id: str) -> None:
    """The process running ``job_id`` died under it (WorkerLostError, reported in the
    pool's main process): drop the job's busy record and checkin, which that process
    can no longer clear. Without this they would stay for the pool's lifetime (a ghost
    busy or stalled row; the job lookup would say "running" for good)."""
    try:
        obs = Observer.for_app(app)
        if obs is not None:
            obs.scripts("busy", [obs.keys.busy(obs.pool_id), obs.keys.checkins,
                                 obs.keys.stop_requests, obs.keys.stats],
                        ["", "lost", job_id, "", "", "", 0])
    except Exception as exc:
        logger.warning("celery_ext: could not clear the busy record of lost job %s: %s",
                       one_line(job_id), exc)


@task_failure.connect(weak=False)
def _on_failure(sender: Any = None, task_id: str | None = None, exception: Any = None,
                **kw: Any) -> None:
    """Celery reports a lost worker in the main process with this signal when it does
    not requeue the job (``acks_late`` off, the default without ``install(app)``); the
    requeue case goes through ``celery_ext.worker.request.Request`` (``install(app)``)."""
    if isinstance(exception, WorkerLostError) and task_id and sender is not None:
        job_lost(sender.app, task_id)


def _forget_observers_after_fork() -> None:
    """A child forked from a process that built an observer (the main process, after a
    lost job) builds its own: the parent's lock and thread are not its."""
    global _observers_lock
    _observers.clear()
    _observers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_observers_after_fork)


@worker_process_shutdown.connect(weak=False)
def _on_process_shutdown(**kwargs: Any) -> None:
    """A prefork child exits: write the counters it still holds."""
    flush_observers()


def stop_observers() -> None:
    """Write what each observer of this process holds, end its thread and forget it
    (its worker pool stops; a job of a worker started later makes a new one)."""
    with _observers_lock:
        observers = list(_observers.values())
        _observers.clear()
    for obs in observers:
        try:
            obs.stop()
        except Exception as exc:
            logger.warning("celery_ext: could not write job counters: %s", exc)


def flush_observers() -> None:
    """Write the counters this process still holds (its worker pool calls this when it
    stops; a prefork child at its exit)."""
    for obs in list(_observers.values()):
        try:
            obs.flush(force_stats=True)
        except Exception as exc:
            logger.warning("celery_ext: could not write job counters: %s", exc)
