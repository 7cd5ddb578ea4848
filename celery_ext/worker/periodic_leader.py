"""Periodic jobs: the app's ``beat_schedule`` and the entries set at runtime, run by the
worker pools, no ``celery beat``.

Every worker pool (unless the setting ``periodic`` is off) runs a :class:`PeriodicLeader`
thread, also when its app has no ``beat_schedule``: entries set at runtime
(``store/runtime_schedules.py``) need a leader too. The one whose pool holds the lease
``{ns}:periodic_leader`` runs :meth:`Periodic.tick`: it enqueues each due run and sleeps
until the next due time. The lease lives the holder's own ``dead_after`` and the holder
renews it at least every ``heartbeat_interval``; the others wait until it may run out
(its ``PTTL``), so when the leading pool dies (SIGKILL, lost host) another takes over
within the dead pool's ``dead_after``, the same time after which the reaper calls it
dead; a pool that stops cleanly gives the lease up and wakes the others at once
(``{ns}:periodic_handover``). The new leader carries on from the state in Redis. Nothing
here keeps time on a host: "now" is Redis ``TIME``; due times are the entry's Celery
schedule asked what comes after a given moment (``options/periodic_schedule.py``).

Runtime entries
---------------
Each pass reads the runtime entries (``{ns}:periodic_runtime``) before the entries' state,
so an entry set, changed or removed at runtime counts from the leader's next pass, in
every pool, with no deploy. A runtime entry wins over the ``beat_schedule`` entry of the
same name; when it is removed, the app's entry comes back (with due times of its own
schedule). A record that does not pass ``check_entry`` (written by hand) is skipped with
one log line. A changed schedule gives the entry a new spec: its next due time is the
first of the new schedule after the change (``periodic_sync.lua``); a leader that planned
a run under the old spec finds it gone and writes nothing (``periodic_run.lua``), and one
that read the old record does not write its schedule back over the new one.

Exactly once per due time
-------------------------
Each entry has a state hash ``{ns}:periodic:<name>`` whose ``next_due`` field is the
first due time not yet enqueued. A run is published through Celery (celery.beat's own
``Scheduler.apply_async``: the entry's args, kwargs and options) with a deterministic
job id per (namespace, entry, due time); the producer writes it with a script that
pushes only if ``next_due`` still holds the due time this run was planned from, and
moves it on in the same call (``producer/periodic_run.py``; on a cluster, two steps
that a run record in the job queue's copy keeps exactly once). Two leaders (a stalled
one and its successor) or a publish that Kombu retries after a lost reply enqueue a
due time once.

Late and missed runs
--------------------
A due time is *missed* when a later due time of its entry has come as well before a
leader enqueues it (a failover, every pool down, a pass slower than the period), or
when it is more than ``periodic_grace`` late. ``periodic_missed`` decides what missed
due times get: ``once`` (default, as ``celery beat`` does) one run for all of them,
``skip`` none (the latest due time still runs if it is at most ``periodic_grace`` late),
``all`` one each. A paused entry's due times pass without runs.

Outcomes
--------
A run carries the headers ``celery_ext_periodic`` (entry name) and ``celery_ext_due``;
when it ends, the process that ran it records success, failure or retry on the entry
(``task_postrun``, :func:`connect_signals`). Readers fall back to the result backend
for a run with no recorded outcome (``admin/periodic_entries.py``).
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
from celery_ext.store.runtime_schedules import (
    InvalidPeriodicEntry,
    entry_from_record,
    read_records,
)
from celery_ext.store.scripts import Scripts
from celery_ext.text import one_line
from celery_ext.worker.background import BackgroundLoop

logger = logging.getLogger("celery_ext.worker.periodic_leader")

#: A state hash of an entry no longer in the schedule is kept this long (ms), so a
#: rolling deploy that drops and re-adds it keeps its pause flag and history.
STALE_STATE_TTL_MS = 7 * 24 * 3600 * 1000
#: A pool waiting for another's lease asks again this long (s) after it may have run
#: out (the holder's renewal and this pool's clock need not agree to the millisecond).
LEASE_SLACK = 0.01


# -- the leader's part -----------------------------------------------------------------------
class Periodic:
    """Runs one app's ``beat_schedule`` and the runtime entries while its
    :class:`PeriodicLeader` leads."""

    def __init__(self, app: Any, client: redis.Redis, settings: Settings,
                 entries: dict[str, ScheduleEntry] | None = None) -> None:
        self.app = app
        self.client: Any = client
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.scripts = Scripts(client)
        #: The app's ``beat_schedule``.
        self.config_entries = load_entries(app) if entries is None else entries
        #: What the last pass runs: the app's entries, runtime entries over them.
        self.entries: dict[str, ScheduleEntry] = dict(self.config_entries)
        #: The runtime record (its text) behind each entry of ``entries`` that has one.
        self.records: dict[str, str] = {}
        #: Broken runtime records already logged (name -> text): one line each.
        self._broken: dict[str, str] = {}
        self.scheduler = Scheduler(app, lazy=True)
        self.tz = app.timezone
        self.synced = False
        self.enqueued = 0
        self._wake_at = 0.0  # monotonic: when tick() next reads Redis

    @classmethod
    def for_app(cls, app: Any, client: redis.Redis, settings: Settings) -> Periodic | None:
        """The app's schedule runner, or None when the setting ``periodic`` is off. An app
        without a ``beat_schedule`` gets one as well: it runs the runtime entries."""
        if not settings.periodic:
            return None
        periodic = cls(app, client, settings)
        if periodic.config_entries:
            logger.info("celery_ext: the worker pools run %d periodic job entr%s "
                        "(beat_schedule; no celery beat needed)", len(periodic.config_entries),
                        "y" if len(periodic.config_entries) == 1 else "ies")
        return periodic

    def view(self, records: dict[str, str]) -> None:
        """Set :attr:`entries` from the app's entries and the runtime ``records`` (name ->
        text), runtime over config; a broken record hides its name and is logged once."""
        entries = dict(self.config_entries)
        kept: dict[str, str] = {}
        for name, raw in records.items():
            try:
                entries[name] = entry_from_record(name, raw, self.app)
            except InvalidPeriodicEntry as exc:
                entries.pop(name, None)
                if self._broken.get(name) != raw:
                    logger.error("celery_ext: runtime periodic job entry skipped: %s",
                                 one_line(str(exc)))
                    self._broken[name] = raw
                continue
            kept[name] = raw
            self._broken.pop(name, None)
        self.entries, self.records = entries, kept

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
            args += [name, spec(entry, self.tz), first, entry.task, describe(entry.schedule),
                     self.records.get(name, "")]
        self.scripts("periodic_sync",
                     [k.periodic, k.periodic_runtime, *(k.periodic_entry(n) for n in names),
                      *(k.periodic_entry(n) for n in stale)],
                     [*args, *stale, STALE_STATE_TTL_MS])
        self.synced = True

    def tick(self) -> float:
        """The leader's call each time it wakes: :meth:`run_due` when the next due time
        has come. Returns seconds until it wants to be called again. Redis errors
        propagate (the leader thread retries); any other error is logged, never raised,
        so the leader keeps its lease."""
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
        self.view(read_records(self.client, self.keys))
        if not self.entries:  # nothing to run: one command a pass
            if not self.synced:
                self.sync(0)  # drops the entries a past schedule left in the index
            return self.settings.promote_interval
        now, rows = self._read()
        if not self.synced or any(r[0] is None or r[1] != spec(self.entries[n], self.tz)
                                  for n, r in rows.items()):
            if not self.synced:
                logger.info("celery_ext: this worker pool leads: it enqueues the periodic jobs")
            self.sync(now)
            now, rows = self._read()
        soonest = now + int(self.settings.promote_interval * 1000)
        for name, (next_due, planned, paused) in rows.items():
            entry = self.entries[name]
            if next_due is None or planned != spec(entry, self.tz):
                continue  # deleted or changed meanwhile: the next pass reads it again
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
            scope = self.settings.global_keyprefix + self.settings.namespace
            run = PeriodicRun(name, run_id(scope, name, step.due_ms),
                              step.expected_ms, step.due_ms, step.next_ms, step.passed,
                              spec(entry, self.tz))
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


class PeriodicLeader(BackgroundLoop):
    """The thread that runs :class:`Periodic` while this pool holds the periodic lease
    (``start()``/``stop()`` around the one-shot :meth:`step`; owned by the
    ``WorkerPool``)."""

    thread_name = "celery_ext-periodic"

    def __init__(self, periodic: Periodic, pool_id: str) -> None:
        self.periodic = periodic
        self.client: Any = periodic.client
        self.settings = periodic.settings
        self.keys = periodic.keys
        self.scripts = periodic.scripts
        self.pool_id = pool_id
        #: The lease's life: this pool's dead_after, as the reaper judges the pool by.
        self.lease_ms = int(self.settings.dead_after * 1000)
        self.leader = False
        BackgroundLoop.__init__(self)
        self._failing = False

    def hold(self) -> tuple[bool, float]:
        """Take the lease if it is free, renew it if this pool holds it. Returns (leads,
        seconds until another pool's lease may run out)."""
        leads, left_ms = self.scripts("periodic_lease", [self.keys.periodic_leader],
                                      [self.pool_id, "hold", self.lease_ms, ""])
        return bool(int(leads)), max(0, int(left_ms)) / 1000

    def step(self) -> float:
        """One round: hold the lease; while leading, :meth:`Periodic.tick`. Returns how
        long to wait before the next round: until the next due time, but at most a
        heartbeat interval (the lease is renewed well within its life) while leading;
        until the holder's lease may run out while not."""
        leads, left = self.hold()
        if not leads:
            if self.leader:
                logger.info("celery_ext: another worker pool leads the periodic jobs now")
            self.leader = False
            self.periodic.synced = False  # it syncs again when it leads again
            return left + LEASE_SLACK
        self.leader = True
        return min(self.periodic.tick(), self.settings.heartbeat_interval)

    def release(self) -> None:
        """Give up the lease (if held) and wake the other pools to take it."""
        if not self.leader:
            return
        self.leader = False
        self.scripts("periodic_lease", [self.keys.periodic_leader],
                     [self.pool_id, "release", "", self.keys.periodic_handover])

    # -- loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        pubsub: Any = None
        while not self._stop.is_set():
            try:
                if pubsub is None:  # before the round: a handover meanwhile still wakes us
                    pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self.keys.periodic_handover)
                try:
                    wait = self.step()
                except redis.RedisError:
                    raise
                except Exception:
                    logger.exception("celery_ext: periodic jobs leader round failed (retried)")
                    wait = self.settings.heartbeat_interval
                else:
                    if self._failing:
                        logger.log(self._outage_level(), "celery_ext: periodic jobs leader "
                                   "reached Redis again")
                        self._failing = False
                # Inside the try: the handover listener's read fails too when Redis goes.
                self._sleep(pubsub, wait)
            except redis.RedisError as exc:
                if not self._failing:
                    logger.log(self._outage_level(logging.ERROR), "celery_ext: periodic jobs "
                               "leader cannot reach Redis: %s (will retry)", exc)
                    self._failing = True
                if pubsub is not None:
                    self._close_listener(pubsub, "handover")
                    pubsub = None
                self._stop.wait(min(self.settings.heartbeat_interval, 1.0))
        if pubsub is not None:
            pubsub.close()

    def _outage_level(self, level: int = logging.INFO) -> int:
        """How loud this leader is about an outage: ``level`` while it has entries to run;
        DEBUG with none (every pool runs a leader, for entries set at runtime), since
        the pool's heartbeat and requeuer report the outage already."""
        return level if self.periodic.entries else logging.DEBUG

    def _sleep(self, pubsub: Any, seconds: float) -> None:
        """Wait ``seconds``, or until a leader hands over (pub/sub), or stop()."""
        self._wait_for_message(pubsub, seconds)

    def stop(self) -> None:
        self.stop_loop()
        try:
            self.release()
        except redis.RedisError as exc:
            logger.warning("celery_ext: could not hand over the periodic jobs: %s", exc)


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
            record_outcome(obs.scripts, obs.keys, name, task_id, state)
    except Exception as exc:
        logger.warning("celery_ext: could not record the outcome of periodic job %s[%s]: %s",
                       one_line(name), one_line(task_id), exc)


def record_outcome(scripts: Scripts, keys: Keys, name: str, job_id: str,
                   state: str | None) -> bool:
    """Record a run's end on its entry, unless the entry has no state any more (it left
    the schedule and its state expired): returns whether it was recorded."""
    return bool(scripts("periodic_outcome", [keys.periodic_entry(name)],
                        [OUTCOMES.get(state or "", "failure"), job_id]))


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
