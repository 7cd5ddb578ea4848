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
recorded outcome (:func:`entry_rows`).
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypedDict

import redis
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule
from celery.signals import beat_init, task_postrun
from kombu.exceptions import OperationalError
from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings, uses_our_transport
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.worker.periodic_leader")

#: Message header naming the entry a run belongs to.
HEADER = "celery_ext_periodic"
#: Message header holding the run's due time (ms, Redis clock); absent on a run-now.
DUE_HEADER = "celery_ext_due"
#: Most due times of one entry computed in one pass (a long outage of a frequent entry
#: is jumped over, not walked).
MAX_DUE_TIMES = 1000
#: A state hash of an entry no longer in the schedule is kept this long (ms), so a
#: rolling deploy that drops and re-adds it keeps its pause flag and history.
STALE_STATE_TTL_MS = 7 * 24 * 3600 * 1000
#: Entry options that would make a run a scheduled job (refused: the run is due now).
DELAY_OPTIONS = ("countdown", "eta")


# -- one run, handed from the scheduler to the producer --------------------------------------
@dataclass
class PeriodicRun:
    """One run of an entry being published; ``outcome`` is set by the producer."""

    entry: str
    job_id: str
    #: The due time the run was planned from (``next_due`` must still say it); None
    #: for a run-now outside the schedule.
    expected_ms: int | None
    due_ms: int
    #: ``next_due`` after this run (None: unchanged, a run-now).
    next_ms: int | None
    #: Due times this run stands for without their own run (missed, ``once``).
    passed: int = 0
    #: The script's answer: 1 pushed, 2 pushed before (same job id), 0 another leader
    #: took this due time, -1 paused, -2 moved on without a run as asked.
    outcome: int | None = None

    def script_args(self) -> list[Any]:
        """ARGV[1..5] of ``periodic_run.lua``."""
        return ["" if self.expected_ms is None else self.expected_ms, self.due_ms,
                "" if self.next_ms is None else self.next_ms, self.passed, self.job_id]


_current: ContextVar[PeriodicRun | None] = ContextVar("celery_ext_periodic", default=None)


def current_run() -> PeriodicRun | None:
    """The run being published in this context (read by ``producer.Enqueuer.put``)."""
    return _current.get()


@contextmanager
def publishing(run: PeriodicRun) -> Iterator[PeriodicRun]:
    token = _current.set(run)
    try:
        yield run
    finally:
        _current.reset(token)


def run_id(namespace: str, name: str, due_ms: int) -> str:
    """The job id of an entry's run for one due time: the same in every pool."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"celery-ext:{namespace}:periodic:{name}:{due_ms}"))


# -- entries and schedule math (celery's own) ------------------------------------------------
def load_entries(app: Any) -> dict[str, ScheduleEntry]:
    """``app.conf.beat_schedule`` as celery.beat's entries; an entry Celery cannot read,
    or one with a countdown/eta, is left out with one log line."""
    entries: dict[str, ScheduleEntry] = {}
    for name, spec in dict(app.conf.beat_schedule or {}).items():
        try:
            entry = ScheduleEntry(**dict(spec, name=name, app=app))
            if not entry.task or entry.schedule is None:
                raise ValueError("needs 'task' and 'schedule'")
            bad = [o for o in DELAY_OPTIONS if (entry.options or {}).get(o) is not None]
            if bad:
                raise ValueError(f"option {bad[0]!r} is not supported (a run is due now)")
        except Exception as exc:
            logger.error("celery_ext: periodic entry %s left out: %s", one_line(str(name)),
                         one_line(str(exc)))
            continue
        entries[str(name)] = entry
    return entries


def _aware(ms: int, tz: Any) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).astimezone(tz)


def next_due_ms(sched: Any, after_ms: int, tz: Any) -> int:
    """The first due time of ``sched`` after ``after_ms`` (ms since the epoch): Celery's
    ``remaining_estimate`` asked at ``after_ms`` with ``after_ms`` as its now."""
    at = _aware(after_ms, tz)
    probe = copy.copy(sched)
    probe.nowfun = lambda: at
    # Celery answers in real (UTC) time, also across a DST change: add it as such.
    due = after_ms + round(probe.remaining_estimate(at).total_seconds() * 1000)
    return due if due > after_ms else after_ms + 1  # a zero-length schedule still moves on


def due_times(sched: Any, next_due: int, now_ms: int, tz: Any,
              limit: int = MAX_DUE_TIMES) -> tuple[list[int], int]:
    """(due times from ``next_due`` up to ``now_ms``, at most ``limit``; the due time
    after the last of them). Past the limit, the second is the first due time after
    ``now_ms`` and the rest are jumped over."""
    dues: list[int] = []
    due = next_due
    while due <= now_ms:
        if len(dues) == limit:
            return dues, next_due_ms(sched, now_ms, tz)
        dues.append(due)
        due = next_due_ms(sched, due, tz)
    return dues, due


@dataclass(frozen=True)
class Step:
    """One call of ``periodic_run.lua`` the leader makes."""

    expected_ms: int
    due_ms: int
    next_ms: int
    passed: int
    enqueue: bool


def plan(dues: list[int], following: int, now_ms: int, grace_ms: int, policy: str,
         paused: bool = False) -> list[Step]:
    """What to do about the pending due times ``dues`` (oldest first) of one entry."""
    if not dues:
        return []
    if paused:
        return [Step(dues[0], dues[-1], following, len(dues), False)]
    if now_ms - dues[0] <= grace_ms or policy == "all":
        nexts = [*dues[1:], following]
        return [Step(d, d, n, 0, True) for d, n in zip(dues, nexts, strict=True)]
    if policy == "skip":
        return [Step(dues[0], dues[-1], following, len(dues), False)]
    return [Step(dues[0], dues[-1], following, len(dues) - 1, True)]  # "once"


def describe(sched: Any) -> str:
    """A schedule for people: ``every 10s``, ``crontab(*/15 * * * *)``, ``<solar: ...>``."""
    if isinstance(sched, crontab):
        return (f"crontab({sched._orig_minute} {sched._orig_hour} {sched._orig_day_of_month} "
                f"{sched._orig_month_of_year} {sched._orig_day_of_week})")
    if isinstance(sched, interval_schedule):
        seconds = sched.run_every.total_seconds()
        return f"every {seconds:g}s"
    return repr(sched)


def _spec(entry: ScheduleEntry) -> str:
    """What makes an entry's due times: when it changes, next_due is computed anew."""
    return f"{entry.task} {entry.schedule!r}"


class PeriodicError(Exception):
    """A run could not be published for a reason retrying will not fix (logged, skipped)."""


def publish_run(scheduler: Scheduler, entry: ScheduleEntry, run: PeriodicRun) -> int:
    """Publish one run through celery.beat's ``Scheduler.apply_async`` (the entry's
    args, kwargs, options) with the run's job id and headers. Returns the producer's
    outcome. Connection errors propagate (the run is retried: same job id);
    anything else raises :class:`PeriodicError`."""
    one = copy.copy(entry)
    headers = {**dict((entry.options or {}).get("headers") or {}), HEADER: run.entry}
    if run.expected_ms is not None:
        headers[DUE_HEADER] = run.due_ms
    one.options = {**(entry.options or {}), "task_id": run.job_id, "headers": headers}
    with publishing(run):
        try:
            scheduler.apply_async(one, advance=False)
        except Exception as exc:
            cause = exc.__cause__ or exc.__context__ or exc
            if isinstance(cause, OperationalError | redis.ConnectionError | redis.TimeoutError):
                raise redis.ConnectionError(str(cause)) from exc
            raise PeriodicError(str(exc)) from exc
    if run.outcome is None:
        raise PeriodicError("the publish did not reach the celery-ext transport "
                            "(task_always_eager, or routed to another broker?)")
    return run.outcome


def run_marker(run: PeriodicRun) -> str:
    """The publish marker of a run on a cluster: one per (entry, due time), as its job id."""
    return f"periodic:{run.job_id}"


def write_run_on_cluster(client: Any, scripts: Scripts, keys: Keys, queue: str,
                         queue_keys: list[str], queue_args: list[Any], index_ttl_ms: int,
                         marker_ttl_ms: int, run: PeriodicRun) -> int:
    """A run of a periodic job on a cluster, where the entry (home copy) and the job
    queue (its own copy) are in different slots, so one script cannot check the entry
    and push: first the run is enqueued in the queue's copy under the publish marker
    of (entry, due time) (``enqueue.lua``: a second enqueue of it is a no-op), then
    ``periodic_run.lua`` on the home copy records it and moves ``next_due`` on only if
    it still holds the due time. A leader that dies in between leaves the due time
    to the next leader, whose enqueue the marker makes a no-op: still exactly once.

    ``queue_keys``/``queue_args``: KEYS[1..3] and ARGV[1..4] of ``enqueue.lua`` in the
    queue's copy (the producer's). Returns the outcome as ``periodic_run.lua`` gives it.
    """
    copy, home = keys.of(queue), keys.home
    if run.expected_ms is not None:
        state = client.hmget(home.periodic_entry(run.entry), "next_due", "paused")
        if bytes_to_str(state[0] or b"") != str(run.expected_ms):
            return 0  # another leader took this due time
        if state[1] == b"1":  # paused: the due time passes without a run
            return int(scripts("periodic_run", [home.periodic_entry(run.entry)],
                               [*run.script_args(), "", "", "", 0, ""]))
    pushed = int(scripts("enqueue", [*queue_keys, copy.job_index, copy.job_index_done,
                                     copy.published(run_marker(run))],
                         [*queue_args, index_ttl_ms, max(1, marker_ttl_ms)]))
    if pushed > 0:  # the home hints beside the copy's (a marker hit pushed nothing)
        client.sadd(home.queues, queue)
        if pushed == 1:
            client.sadd(home.ready, queue)
    return int(scripts("periodic_run", [home.periodic_entry(run.entry)],
                       [*run.script_args(), "", "", "", 0, "", 0, "1"]))


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
            args += [name, _spec(entry), first, entry.task, describe(entry.schedule)]
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
        if not self.synced or any(r[0] is None or r[1] != _spec(self.entries[n])
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


# -- readers and steering (Client) -----------------------------------------------------------
class PeriodicEntry(TypedDict):
    name: str
    task: str | None
    schedule: str | None
    next_due: float | None  # seconds, Redis clock
    last_due: float | None  # the due time of the last run (None for a run-now)
    last_run_at: float | None  # when the last run was enqueued
    last_job_id: str | None
    last_outcome: str | None  # success, failure, retry, pending (not finished), or None
    runs: int
    missed: int  # due times passed over without their own run (missed, skipped, paused)
    paused: bool
    error: str | None  # why the last due time could not be enqueued


_OUTCOMES = {"SUCCESS": "success", "FAILURE": "failure", "RETRY": "retry"}


def _seconds(value: str | None) -> float | None:
    return int(value) / 1000 if value not in (None, "") else None


def entry_rows(client: Any, keys: Keys, app: Any = None) -> list[PeriodicEntry]:
    """Every entry the leader recorded, by name, with its last run's outcome (from the
    worker, else from ``app``'s result backend when there is one)."""
    names = sorted(bytes_to_str(n) for n in client.smembers(keys.periodic))
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.periodic_entry(name))
        hashes = pipe.execute()
    rows: list[PeriodicEntry] = []
    for name, raw in zip(names, hashes, strict=True):
        h = {bytes_to_str(a): bytes_to_str(b) for a, b in raw.items()}
        job_id = h.get("last_job_id") or None
        outcome = h.get("outcome") if job_id and h.get("outcome_job_id") == job_id else None
        if job_id and outcome is None:
            outcome = _backend_outcome(app, job_id)
        rows.append(PeriodicEntry(
            name=name, task=h.get("task"), schedule=h.get("schedule"),
            next_due=_seconds(h.get("next_due")), last_due=_seconds(h.get("last_due")),
            last_run_at=_seconds(h.get("last_run_at")), last_job_id=job_id,
            last_outcome=outcome, runs=int(h.get("runs") or 0),
            missed=int(h.get("missed") or 0), paused=h.get("paused") == "1",
            error=h.get("error") or None))
    return rows


def _backend_outcome(app: Any, job_id: str) -> str:
    """The result backend's word on a run, "pending" when it has none (or no backend)."""
    backend = getattr(app, "backend", None) if app is not None else None
    if backend is None or type(backend).__name__ == "DisabledBackend":
        return "pending"
    try:
        state = app.AsyncResult(job_id).state
    except Exception:
        return "pending"
    return _OUTCOMES.get(state, "pending")


def set_paused(client: Any, keys: Keys, name: str, paused: bool) -> bool | None:
    """Pause or resume an entry; None when no entry has that name, else whether it
    changed. A paused entry's due times pass without runs (``missed`` counts them)."""
    if not client.sismember(keys.periodic, name):
        return None
    key = keys.periodic_entry(name)
    if paused:
        return bool(client.hset(key, "paused", "1"))
    return bool(client.hdel(key, "paused"))


def run_now(app: Any, client: Any, keys: Keys, name: str) -> str | None:
    """Enqueue one run of entry ``name`` now, outside its schedule (also when paused).
    Returns its job id, or None when ``app``'s ``beat_schedule`` has no such entry."""
    entry = load_entries(app).get(name)
    if entry is None:
        return None
    if not client.sismember(keys.periodic, name):
        client.sadd(keys.periodic, name)  # shown before any leader recorded it
    run = PeriodicRun(name, str(uuid.uuid4()), None, 0, None)
    publish_run(Scheduler(app, lazy=True), entry, run)
    return run.job_id


# -- signals: outcomes, and a warning for celery beat ----------------------------------------
@task_postrun.connect(weak=False)
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
                "outcome": _OUTCOMES.get(state or "", "failure"), "outcome_job_id": task_id})
    except Exception as exc:
        logger.warning("celery_ext: could not record the outcome of periodic job %s[%s]: %s",
                       one_line(name), one_line(task_id), exc)


@beat_init.connect(weak=False)
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
