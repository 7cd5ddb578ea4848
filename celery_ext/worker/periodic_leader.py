"""Periodic jobs: the app's ``beat_schedule`` run by the worker pools, no ``celery beat``.

Every worker pool whose app has a ``beat_schedule`` (and the setting ``periodic`` not
turned off) gives its requeuer a :class:`Periodic`. Only the requeuer that holds the
``{ns}:requeuer`` lease (the leader, see ``requeuer.py``) calls :meth:`Periodic.tick`;
when it dies another pool takes the lease within ``promote_interval + 1 s`` plus one
follower pass, and carries on from the state in Redis. Nothing here keeps time on a
host: "now" is Redis ``TIME``, and due times are computed by the entry's own Celery
schedule (``crontab``, ``schedule``/timedelta/number, ``solar``) asked what comes after
a given moment, with that moment as its "now".

Exactly once per due time
-------------------------
Each entry has a state hash ``{ns}:periodic:<name>`` whose ``next_due`` field is the
first due time not yet enqueued. A run is published through Celery (celery.beat's own
``Scheduler.apply_async``: the entry's args, kwargs and options) with a deterministic
job id per (namespace, entry, due time) and a :class:`PeriodicRun` in a context
variable; the producer (``producer.Enqueuer``) sees it and writes the job with the
``periodic_run`` script instead of a plain enqueue. The script pushes only if
``next_due`` still holds the due time this run was planned from, and moves it on in
the same call: two leaders (a slow one and its successor) or a publish that Kombu
retries after a lost reply enqueue it once. A run whose job id was already recorded
answers "done" (the retry of a publish whose write landed).

Late and missed runs
--------------------
Due times at most ``periodic_grace`` late (a failover, a slow pass) are each enqueued
for their own due time. When the oldest pending due time is older than that (every
pool was down), the due times are *missed* and ``periodic_missed`` decides: ``once``
(default, like ``celery beat`` after a restart) enqueues one run for all of them,
``skip`` none, ``all`` one per due time. A paused entry's due times pass without runs.

Outcomes
--------
A run carries the headers :data:`HEADER` (entry name) and :data:`DUE_HEADER`; when
it ends, the process that ran it records success, failure or retry on the entry
(``task_postrun``). Readers fall back to the result backend for a run with no
recorded outcome (``admin/periodic_entries.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from celery.beat import ScheduleEntry, Scheduler
from celery.signals import beat_init, task_postrun
from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings, uses_our_transport
from celery_ext.options.periodic_schedule import (
    Step,
    describe,
    due_times,
    load_entries,
    next_due_ms,
    plan,
    spec,
)
from celery_ext.producer.periodic_run import (
    HEADER,
    OUTCOMES,
    PeriodicError,
    PeriodicRun,
    publish_run,
    run_id,
)
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.worker.periodic_leader")

#: A state hash of an entry no longer in the schedule is kept this long (ms), so a
#: rolling deploy that drops and re-adds it keeps its pause flag and history.
STALE_STATE_TTL_MS = 7 * 24 * 3600 * 1000


# -- the leader's part -----------------------------------------------------------------------
class Periodic:
    """Runs one app's ``beat_schedule`` from the requeuer that holds the lease."""

    def __init__(self, app: Any, client: redis.Redis, settings: Settings,
                 entries: dict[str, ScheduleEntry] | None = None) -> None:
        self.app = app
        self.client: Any = client
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.scripts = Scripts(client)
        self.entries = load_entries(app) if entries is None else entries
        self.scheduler = Scheduler(app, lazy=True)
        self.tz = app.timezone
        self.synced = False
        self.enqueued = 0
        self._wake_at = 0.0  # monotonic: when tick() next reads Redis

    @classmethod
    def for_app(cls, app: Any, client: redis.Redis, settings: Settings) -> Periodic | None:
        """The app's schedule runner, or None when it has no ``beat_schedule`` or the
        setting ``periodic`` is off."""
        if not settings.periodic or not app.conf.beat_schedule:
            return None
        periodic = cls(app, client, settings)
        if not periodic.entries:
            return None
        logger.info("celery_ext: the worker pools run %d periodic job entr%s "
                    "(beat_schedule; no celery beat needed)", len(periodic.entries),
                    "y" if len(periodic.entries) == 1 else "ies")
        return periodic

    def sync(self, now_ms: int) -> None:
        """Record the entries in the index (dropping those the schedule no longer has)
        and give each entry without a next due time (or with another schedule) one."""
        k = self.keys
        names = list(self.entries)
        stale = [n for n in (bytes_to_str(m) for m in self.client.smembers(k.periodic))
                 if n not in self.entries]
        args: list[Any] = [len(names)]
        for name in names:
            entry = self.entries[name]
            first = next_due_ms(entry.schedule, now_ms, self.tz)
            args += [name, spec(entry), first, entry.task, describe(entry.schedule)]
        self.scripts("periodic_sync",
                     [k.periodic, *(k.periodic_entry(n) for n in names),
                      *(k.periodic_entry(n) for n in stale)],
                     [*args, *stale, STALE_STATE_TTL_MS])
        self.synced = True

    def tick(self) -> float:
        """The leader's call after each requeuer pass: :meth:`run_due` when the next due
        time has come. Returns seconds until it wants to be called again. Redis errors
        propagate (the requeuer retries); any other error is logged, never raised, so
        the requeuer keeps promoting."""
        left = self._wake_at - time.monotonic()
        if self.synced and left > 0:
            return left
        try:
            wait = self.run_due()
        except redis.RedisError:
            raise
        except Exception:
            logger.exception("celery_ext: periodic jobs pass failed (retried)")
            wait = self.settings.promote_interval
        self._wake_at = time.monotonic() + wait
        return wait

    def run_due(self) -> float:
        """One pass: enqueue every due run. Returns seconds until the next due time
        (at most ``promote_interval``: paused and resumed entries are seen by then)."""
        now, rows = self._read()
        if not self.synced or any(r[0] is None or r[1] != spec(self.entries[n])
                                  for n, r in rows.items()):
            if not self.synced:
                logger.info("celery_ext: this worker pool leads: it enqueues the periodic jobs")
            self.sync(now)
            now, rows = self._read()
        soonest = now + int(self.settings.promote_interval * 1000)
        for name, (next_due, _, paused) in rows.items():
            if next_due is None:  # deleted meanwhile: the next pass syncs again
                continue
            entry = self.entries[name]
            dues, following = due_times(entry.schedule, int(next_due), now, self.tz)
            steps = plan(dues, following, now, int(self.settings.periodic_grace * 1000),
                         self.settings.periodic_missed, paused=paused == "1")
            done = self._take(name, entry, steps)
            soonest = min(soonest, following if done == len(steps) else now)
        return max(0.0, (soonest - now) / 1000)

    def _read(self) -> tuple[int, dict[str, list[str | None]]]:
        """Redis time (ms) and each entry's next_due, spec and paused, in one round trip."""
        names = list(self.entries)
        cluster = self.keys.cluster  # (a cluster pipeline refuses TIME: asked first)
        with self.client.pipeline(transaction=False) as pipe:
            if not cluster:
                pipe.time()
            for name in names:
                pipe.hmget(self.keys.periodic_entry(name), "next_due", "spec", "paused")
            reply = pipe.execute()
        if cluster:
            reply.insert(0, self.client.time())
        seconds, micros = reply[0]
        rows = {n: [bytes_to_str(v) if v is not None else None for v in r]
                for n, r in zip(names, reply[1:], strict=True)}
        return int(seconds) * 1000 + int(micros) // 1000, rows

    def _take(self, name: str, entry: ScheduleEntry, steps: list[Step]) -> int:
        """Make the calls of a plan; stops at the first that finds the entry moved on
        (another leader) or paused. Returns how many steps ran as planned."""
        for i, step in enumerate(steps):
            run = PeriodicRun(name, run_id(self.settings.namespace, name, step.due_ms),
                              step.expected_ms, step.due_ms, step.next_ms, step.passed)
            if step.enqueue:
                try:
                    outcome = publish_run(self.scheduler, entry, run)
                except PeriodicError as exc:
                    logger.error("celery_ext: periodic job %s: run due at %d not enqueued: %s",
                                 one_line(name), step.due_ms, one_line(str(exc)))
                    run.passed += 1
                    outcome = self._advance(run, error=str(exc))
            else:
                outcome = self._advance(run)
            if outcome in (1, 2):
                self.enqueued += outcome == 1
            elif outcome != -2:
                return i
        return len(steps)

    def _advance(self, run: PeriodicRun, error: str = "") -> int:
        """Move ``next_due`` on without a run (paused, skipped, or not publishable)."""
        k = self.keys
        return int(self.scripts("periodic_run", [k.periodic_entry(run.entry)],
                                [*run.script_args(), "", "", "", 0, one_line(error, 500)]))


# -- signals: outcomes, and a warning for celery beat ----------------------------------------
def _record_outcome(sender: Any = None, task_id: str | None = None, task: Any = None,
                    state: str | None = None, **kw: Any) -> None:
    """A run ended: record its outcome on its entry (the process that ran it)."""
    if task is None or not task_id:
        return
    name = task.request.get(HEADER)
    if not isinstance(name, str) or not name:
        return
    from celery_ext.worker.observer import Observer

    try:
        obs = Observer.for_app(task.app)
        if obs is not None:
            obs.client.hset(obs.keys.periodic_entry(name), mapping={
                "outcome": OUTCOMES.get(state or "", "failure"), "outcome_job_id": task_id})
    except Exception as exc:
        logger.warning("celery_ext: could not record the outcome of periodic job %s[%s]: %s",
                       one_line(name), one_line(task_id), exc)


def _warn_beat(sender: Any = None, **kw: Any) -> None:
    """``celery beat`` started for an app whose worker pools already run its schedule."""
    app = getattr(sender, "app", None)
    if app is None or not uses_our_transport(app.conf) or not app.conf.beat_schedule:
        return
    try:
        on = Settings.load(app.conf.broker_transport_options).periodic
    except ValueError:
        return
    if on:
        logger.warning(
            "celery_ext: the worker pools already run this app's beat_schedule; with celery "
            "beat running too, every periodic job is enqueued twice. Stop celery beat, or "
            "set the transport option periodic=False (CELERY_EXT_PERIODIC=0) for the pools")


def connect_signals() -> None:
    """Connect :func:`_record_outcome` (``task_postrun``) and :func:`_warn_beat`
    (``beat_init``). Called where a process starts using the transport (its
    ``Transport``, made in a worker's main process before a prefork pool forks, and in
    ``celery beat`` before ``beat_init``); connecting again changes nothing."""
    task_postrun.connect(_record_outcome, weak=False, dispatch_uid=_record_outcome.__qualname__)
    beat_init.connect(_warn_beat, weak=False, dispatch_uid=_warn_beat.__qualname__)
