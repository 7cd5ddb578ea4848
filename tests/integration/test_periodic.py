"""Periodic jobs (issue 14): the app's beat_schedule run by the worker pools, no celery beat.

Real server; the end-to-end tests run real ``celery worker`` subprocesses of
``tests.apps.proj_periodic`` (entry ``every``: each second; entry ``hourly``: a crontab that
does not fall due during a test). Schedule math is Celery's; the pure tests check that
we ask it the right question on the Redis clock.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
import warnings
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import crontab, schedule

from celery_ext.client import Client
from celery_ext.config import Settings
from celery_ext.options.periodic_schedule import Step, due_times, next_due_ms, plan
from celery_ext.producer.periodic_run import run_id
from celery_ext.store.clock import now_ms
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.worker.periodic_leader import Periodic, PeriodicLeader, record_outcome
from tests.apps import proj
from tests.helpers import Factory, Mode, celery_cli, start_workers, wait_for

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
APP = "tests.apps.proj_periodic"
#: Timings of the worker pools here: the periodic lease lives dead_after.
FAST = {"CELERY_EXT_PROMOTE_INTERVAL": "0.5", "CELERY_EXT_HEARTBEAT_INTERVAL": "0.5",
        "CELERY_EXT_DEAD_AFTER": "1.5", "CELERY_EXT_REAP_INTERVAL": "0.5"}
LEADS = r"this worker pool leads: it enqueues the periodic jobs"


def _ms(dt: datetime) -> int:
    return round(dt.timestamp() * 1000)


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def runs(rec: redis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(v) for v in rec.lrange(f"runs:{key}", 0, -1)]


# -- schedule math (pure) -------------------------------------------------------------------
def test_next_due_is_celerys_answer_on_the_given_clock() -> None:
    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    tz = app.timezone
    at = _ms(datetime(2026, 3, 29, 0, 7, 30, tzinfo=UTC))  # 01:07:30 in Paris, DST day
    assert _utc(next_due_ms(crontab(minute="*/15", app=app), at, tz)) == \
        datetime(2026, 3, 29, 0, 15, tzinfo=UTC)
    # 03:00 Paris on the day clocks jump from 02:00 CET to 03:00 CEST is 01:00 UTC.
    daily = crontab(minute=0, hour=3, app=app)
    first = next_due_ms(daily, at, tz)
    assert _utc(first) == datetime(2026, 3, 29, 1, 0, tzinfo=UTC)
    assert _utc(next_due_ms(daily, first, tz)) == datetime(2026, 3, 30, 1, 0, tzinfo=UTC)
    # A due time is never its own successor; weekly on Monday at 09:30 Paris (CEST).
    weekly = crontab(minute=30, hour=9, day_of_week="mon", app=app)
    assert _utc(next_due_ms(weekly, at, tz)) == datetime(2026, 3, 30, 7, 30, tzinfo=UTC)
    # Clocks go back (03:00 CEST -> 02:00 CET): Celery's crontab gives the repeated hour
    # no runs (docs/periodic.md says so).
    app.conf.timezone = "Europe/Berlin"
    quarter = crontab(minute="*/15", app=app)
    at_245 = _ms(datetime(2026, 10, 25, 0, 45, tzinfo=UTC))  # 02:45+02:00
    assert _utc(next_due_ms(quarter, at_245, app.timezone)) == \
        datetime(2026, 10, 25, 2, 0, tzinfo=UTC)  # 03:00+01:00, 75 minutes later
    every = schedule(timedelta(seconds=2.5), app=app)
    assert next_due_ms(every, at, tz) == at + 2500
    dues, following = due_times(every, at, at + 6000, tz)
    assert dues == [at, at + 2500, at + 5000] and following == at + 7500
    dues, following = due_times(every, at, at + 3_600_000, tz, limit=4)
    assert len(dues) == 4 and following == at + 3_600_000 + 2500  # the rest jumped over


def test_late_runs_each_run_and_missed_ones_follow_the_policy() -> None:
    """A due time overtaken by a later one (a failover, every pool down) is missed, as is
    one more than the grace late: ``once`` gives them one run, ``skip`` none (the
    latest, on time, still runs), ``all`` one each. A single due time on time runs."""
    dues, now = [1000, 2000, 3000], 3500
    each = [Step(1000, 1000, 2000, 0, True), Step(2000, 2000, 3000, 0, True),
            Step(3000, 3000, 4000, 0, True)]
    one_for_all = [Step(1000, 3000, 4000, 2, True)]
    assert plan(dues, 4000, now, grace_ms=5000, policy="once") == one_for_all
    assert plan(dues, 4000, now, grace_ms=5000, policy="skip") == one_for_all
    assert plan(dues, 4000, now, grace_ms=5000, policy="all") == each
    assert plan(dues, 4000, now + 5000, grace_ms=5000, policy="all") == each
    assert plan(dues, 4000, now + 5000, grace_ms=5000, policy="once") == one_for_all
    assert plan(dues, 4000, now + 5000, grace_ms=5000, policy="skip") == \
        [Step(1000, 3000, 4000, 3, False)]
    assert plan(dues, 4000, now, grace_ms=5000, policy="once", paused=True) == \
        [Step(1000, 3000, 4000, 3, False)]
    for policy in ("once", "skip", "all"):
        assert plan([1000], 2000, 1500, 5000, policy) == [Step(1000, 1000, 2000, 0, True)]
    assert plan([1000], 2000, 9000, 5000, "once") == [Step(1000, 1000, 2000, 0, True)]
    assert plan([1000], 2000, 9000, 5000, "skip") == [Step(1000, 1000, 2000, 1, False)]
    assert plan([], 4000, now, 5000, "once") == []


# -- the leader's pass, in-process ----------------------------------------------------------
@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_periodic

    return proj_periodic.app


def _queued_dues(client: redis.Redis, queue: str) -> list[int]:
    return sorted(json.loads(p)["headers"]["celery_ext_due"]
                  for p in client.lrange(K.queue(queue), 0, -1))


def test_racing_leaders_enqueue_each_due_time_once_and_missed_runs_once(
        app: Any, redis_server: Any, redis_client: redis.Redis) -> None:
    """Four leaders (a slow one and its successors) pass over the same due times: each
    is pushed once (policy ``all``: one run per due time). With ``once``, due times a
    later one overtook (a failover) get one run, and so do due times older than the
    grace (an outage)."""
    every_one = Settings(periodic_grace=10.0, periodic_missed="all")
    leaders = [Periodic(app, redis_server.client(), every_one) for _ in range(4)]
    leaders[0].run_due()  # records the entries and their first due times
    name, queue = "every", "tests.apps.proj_periodic.beat_tick"
    now = now_ms(redis_client)
    redis_client.hset(K.periodic_entry(name), "next_due", now - 2000)  # 3 due times pending
    barrier = threading.Barrier(len(leaders))

    def run(p: Periodic) -> None:
        barrier.wait()
        p.run_due()

    threads = [threading.Thread(target=run, args=(p,)) for p in leaders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dues = _queued_dues(redis_client, queue)
    assert dues[:3] == [now - 2000, now - 1000, now]
    assert len(dues) == len(set(dues)) and dues == list(range(now - 2000, dues[-1] + 1, 1000))
    ids = {json.loads(p)["headers"]["id"] for p in redis_client.lrange(K.queue(queue), 0, -1)}
    assert ids == {run_id("celery_ext", name, d) for d in dues}
    state = Client(redis_client).periodic()
    every = next(e for e in state if e["name"] == name)
    assert every["runs"] == len(dues) and every["missed"] == 0
    assert every["next_due"] is not None and every["next_due"] * 1000 > dues[-1]

    once = Periodic(app, redis_server.client(), Settings(periodic_grace=10.0))
    for late_ms, missed in ((3_250, 3), (20_500, 20)):  # a failover; every pool down
        redis_client.delete(K.queue(queue))
        before = next(e for e in Client(redis_client).periodic() if e["name"] == name)
        now = now_ms(redis_client)
        # (Due times a quarter or half a second off those run above: a due time already
        # run as the entry's last run would not be pushed again.)
        redis_client.hset(K.periodic_entry(name), "next_due", now - late_ms)
        once.run_due()
        (due,) = _queued_dues(redis_client, queue)  # one run for all of them
        assert now - 1000 < due <= now + 1000 and (due - now + late_ms) % 1000 == 0
        every = next(e for e in Client(redis_client).periodic() if e["name"] == name)
        assert every["missed"] - before["missed"] in (missed, missed + 1)
        assert every["runs"] == before["runs"] + 1 and every["last_due"] == due / 1000



@pytest.mark.parametrize("option", ["countdown", "eta"])
def test_a_run_with_a_countdown_or_eta_waits_in_the_scheduled_set_once_per_due_time(
        app: Any, redis_server: Any, redis_client: redis.Redis, option: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry whose options set a countdown (or an eta) has its run written to the
    scheduled set at its due time, due that much later, and not pushed to its job queue
    at once; two leaders passing over the same due time write it once, and the entry
    records the run."""
    delay = {"countdown": 30.0} if option == "countdown" else \
        {"eta": datetime.now(UTC) + timedelta(seconds=30)}
    monkeypatch.setitem(app.conf, "beat_schedule", {"later": {
        "task": "tests.apps.proj_periodic.beat_tick", "schedule": 60.0, "args": ("later",),
        "options": delay}})
    leaders = [Periodic(app, redis_server.client(), Settings(periodic_grace=10.0))
               for _ in range(2)]
    assert list(leaders[0].entries) == ["later"]  # not left out
    leaders[0].run_due()  # records the entry and its first due time, a minute away
    now = now_ms(redis_client)
    redis_client.hset(K.periodic_entry("later"), "next_due", now)
    for leader in leaders:
        leader.run_due()
    assert redis_client.llen(K.queue("tests.apps.proj_periodic.beat_tick")) == 0
    ((tag, due),) = redis_client.zrange(K.scheduled, 0, -1, withscores=True)
    assert now + 25_000 < due < now + 35_000
    record = redis_client.hget(K.scheduled_jobs, tag)
    assert record is not None
    headers = json.loads(record.split(b"\n", 2)[2])["headers"]
    assert headers["id"] == run_id("celery_ext", "later", now)
    (later,) = Client(redis_client).periodic()
    assert later["runs"] == 1 and later["last_due"] == now / 1000

def test_the_periodic_lease_lives_dead_after_and_is_handed_over(
        app: Any, redis_server: Any, redis_client: redis.Redis) -> None:
    """One pool leads; another waits until the lease may run out (the leader's
    dead_after); a clean stop gives it up and wakes the others; a lease set without a
    life is taken."""
    redis_client.delete(K.periodic_leader)
    settings = Settings(dead_after=3.0, heartbeat_interval=1.0)
    a, b = (PeriodicLeader(Periodic(app, redis_server.client(), settings), pool)
            for pool in ("pool-a", "pool-b"))
    assert a.hold() == (True, 3.0)
    leads, left = b.hold()
    assert not leads and 2.5 < left <= 3.0
    assert a.step() <= settings.heartbeat_interval and a.leader  # leading: runs the entries
    assert redis_client.hget(K.periodic_entry("every"), "next_due")
    listener = redis_client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(K.periodic_handover)
    a.release()
    assert wait_for(lambda: listener.get_message(timeout=0.1), 5, "the handover")["data"] == \
        b"pool-a"
    listener.close()
    assert b.hold()[0] and not a.hold()[0]
    redis_client.set(K.periodic_leader, "pool-gone")  # no life
    assert a.hold()[0]


def test_the_spec_holds_the_time_zone_and_a_gone_entry_gets_no_outcome(
        app: Any, redis_server: Any, redis_client: redis.Redis) -> None:
    """Pools whose apps have different time zones compute different due times for one
    crontab: the spec includes the zone, so the entry's next due time is computed anew
    when it changes. An outcome recorded after the entry's state expired does not make
    the state again (it would never expire); a state about to expire keeps its TTL."""
    name = "daily"
    key = K.periodic_entry(name)
    redis_client.delete(key)
    due_at = {}
    for zone in ("Europe/Berlin", "UTC"):
        zoned = Celery(set_as_current=False)
        zoned.conf.timezone = zone
        entry = {name: {"task": "tests.apps.proj_periodic.beat_tick",
                        "schedule": crontab(minute=0, hour=3, app=zoned), "args": ("daily",)}}
        zoned.conf.beat_schedule = entry
        Periodic(zoned, redis_server.client(), Settings()).run_due()
        due_at[zone] = _utc(int(redis_client.hget(key, "next_due") or 0))
    assert (due_at["Europe/Berlin"].hour, due_at["UTC"].hour) in ((2, 3), (1, 3))

    scripts = Scripts(redis_client)
    redis_client.pexpire(key, 60_000)  # left the schedule: kept a while
    assert record_outcome(scripts, K, name, "job-1", "SUCCESS")
    assert redis_client.hget(key, "outcome") == b"success" and redis_client.pttl(key) > 0
    redis_client.delete(key)  # expired
    assert not record_outcome(scripts, K, name, "job-2", "FAILURE")
    assert not redis_client.exists(key)


# -- real worker pools ----------------------------------------------------------------------
def test_three_pools_leader_killed_takeover_within_dead_after_without_a_burst(
        worker_factory: Factory, broker_url: str, redis_client: redis.Redis,
        rec: redis.Redis) -> None:
    """Three pools, a 1-second entry; the leading pool is SIGKILLed midway, then the next
    leader stops cleanly. The takeover after the kill comes within the dead pool's
    ``dead_after`` (4 s here), not the promotion cadence (``promote_interval`` 3 s: the
    requeuer's lease would take up to 7 s); the due times it missed get one run (policy
    ``once``), not a burst of one each. The clean stop hands over at once. Every due
    time is enqueued at most once, and each one is either run or counted as missed."""
    proj.configure(broker_url)
    rec.delete("runs:every")
    dead_after = 4.0
    env = {**FAST, "CELERY_EXT_PROMOTE_INTERVAL": "3", "CELERY_EXT_DEAD_AFTER": str(dead_after)}
    workers = start_workers(worker_factory, 3, APP, env=env)

    def leader() -> Any:
        found = [w for w in workers if w.alive and LEADS in w.log_text()]
        return found[-1] if found else None

    first = wait_for(leader, 20, "a leading pool")
    wait_for(lambda: len(runs(rec, "every")) >= 4, 30, "4 runs")
    first.stop(signal.SIGKILL, timeout=5)  # the whole pool, main process and children
    killed_at = time.time()
    second = wait_for(lambda: leader() not in (None, first) and leader(), 20, "a new leader")
    wait_for(lambda: sum(r["enqueued_at"] > killed_at for r in runs(rec, "every")) >= 3, 30,
             "runs after the failover")
    stopping_at = time.time()
    second.stop(timeout=15)
    third = wait_for(lambda: leader() not in (None, first, second) and leader(), 20,
                     "a third leader")
    wait_for(lambda: sum(r["enqueued_at"] > stopping_at for r in runs(rec, "every")) >= 2,
             30, "runs after the handover")
    third.stop(timeout=15)
    got = runs(rec, "every")
    by_due: dict[int, set[str]] = {}
    for r in got:
        by_due.setdefault(r["due"], set()).add(r["id"])
    # Runs the last pool enqueued while it stopped wait in the queue, not run.
    left = _queued_dues(redis_client, "tests.apps.proj_periodic.beat_tick")
    assert not set(left) & set(by_due)
    for due in left:
        by_due[due] = {run_id("celery_ext", "every", due)}
    dues = sorted(by_due)
    assert all(ids == {run_id("celery_ext", "every", d)} for d, ids in by_due.items())
    assert set(dues) <= set(range(dues[0], dues[-1] + 1, 1000))
    state = next(e for e in Client(redis_client).periodic() if e["name"] == "every")
    assert state["runs"] == len(dues), "a due time was pushed twice"
    skipped = (dues[-1] - dues[0]) // 1000 + 1 - len(dues)
    assert skipped >= 1 and state["missed"] == skipped, (skipped, state)
    # Per due time: a run the killed pool was running (or had run, its ack not yet
    # written) runs again with the same enqueue time, which is no burst of enqueues.
    enqueued = sorted({r["due"]: r["enqueued_at"] for r in got}.values())
    gaps = [b - a for a, b in itertools.pairwise(enqueued)]
    assert min(gaps) > 0.5, f"runs enqueued in a burst: {gaps}"
    after_kill = min(t for t in enqueued if t > killed_at)
    assert after_kill - killed_at <= dead_after + 1.0, after_kill - killed_at
    late = {r["due"]: r["enqueued_at"] - r["due"] / 1000 for r in got}
    assert max(late.values()) <= 1.5, late
    assert max(gaps) >= dead_after - 1.5, "no run waited for the failover"
    handover = [t for t in enqueued if t > stopping_at]
    assert handover and max(gaps[enqueued.index(handover[0]) - 1:]) <= 2.5


def test_gevent_pools_run_each_due_time_once(worker_factory: Factory, broker_url: str,
                                            redis_client: redis.Redis,
                                            rec: redis.Redis) -> None:
    """Two drop-in gevent pools: one leads, and each due time of the 1-second entry is
    enqueued once, on time, none skipped, and run once; the outcome is recorded by the
    greenlet that ran the job."""
    rec.delete("runs:every")
    env = Mode("dropin", broker_url).env(**FAST)
    workers = start_workers(worker_factory, 2, APP, pool="gevent", concurrency=50, env=env)
    wait_for(lambda: len(runs(rec, "every")) >= 5, 20, "five runs of `every`")
    wait_for(lambda: redis_client.hget(K.periodic_entry("every"), "outcome_job_id"), 10,
             "an outcome recorded by the worker")
    stoppers = [threading.Thread(target=w.stop, kwargs={"timeout": 15}) for w in workers]
    for t in stoppers:  # a gevent pool takes seconds to stop: both at once
        t.start()
    for t in stoppers:
        t.join()
    got = runs(rec, "every")
    dues = sorted(r["due"] for r in got)
    assert len(set(dues)) == len(dues), "a due time ran twice"
    assert dues == list(range(dues[0], dues[-1] + 1, 1000)), "a due time was skipped"
    assert all(r["id"] == run_id("celery_ext", "every", r["due"]) for r in got)
    assert max(r["enqueued_at"] - r["due"] / 1000 for r in got) <= 1.5
    # One pool leads; on a loaded machine the lease may pass to the other once (a gevent
    # hub busy past the lease), which the once-per-due-time checks above cover.
    assert sum(LEADS in w.log_text() for w in workers) >= 1
    state = next(e for e in Client(redis_client).periodic() if e["name"] == "every")
    left = _queued_dues(redis_client, "celery")
    assert state["runs"] == len(dues) + len(left) and state["missed"] == 0, (state, left)


def test_dropin_pool_runs_the_schedule_and_the_cli_steers_it(
        worker_factory: Factory, broker_url: str, redis_client: redis.Redis,
        rec: redis.Redis) -> None:
    """Drop-in (only the URL changed): the pool runs the schedule. ``celery ext periodic``:
    ls shows both entries with next and last run and outcome; pause stops the runs of
    ``every``, resume brings them back; run-now runs ``hourly`` at once."""
    rec.delete("runs:every", "runs:hourly")
    env = Mode("dropin", broker_url).env(**FAST)
    start_workers(worker_factory, 1, APP, env=env)
    wait_for(lambda: len(runs(rec, "every")) >= 2, 20, "two runs of `every`")
    client = Client(redis_client)

    def entry(name: str) -> Any:
        return next(e for e in client.periodic() if e["name"] == name)

    def cli(*args: str) -> Any:
        done = celery_cli("-A", APP, "ext", "periodic", *args, broker_url=broker_url, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout

    wait_for(lambda: entry("every")["last_outcome"] == "success", 10, "an outcome")
    # ... recorded by the prefork child that ran the job (not read from the result backend).
    wait_for(lambda: redis_client.hget(K.periodic_entry("every"), "outcome_job_id"), 10,
             "an outcome recorded by the worker")
    entries = {e["name"]: e for e in json.loads(cli("ls", "--json"))}
    assert set(entries) == {"every", "hourly"}
    every, hourly = entries["every"], entries["hourly"]
    assert every["schedule"] == "every 1s" and hourly["schedule"] == "crontab(0 * * * *)"
    assert every["runs"] >= 2 and every["last_job_id"] and not every["paused"]
    assert every["last_outcome"] in ("success", "pending")  # the next run may be under way
    assert every["next_due"] > every["last_run_at"]
    assert hourly["runs"] == 0 and hourly["last_run_at"] is None
    assert hourly["next_due"] % 3600 == 0

    assert "paused every" in cli("pause", "every")
    paused_runs = entry("every")["runs"]
    time.sleep(2.0)
    after = entry("every")
    assert after["paused"] and after["runs"] == paused_runs  # checked in the push's script
    assert after["missed"] >= 1
    text = cli("ls")
    assert "every" in text and "paused" in text and "hourly" in text

    assert "resumed every" in cli("resume", "every")
    wait_for(lambda: entry("every")["runs"] >= after["runs"] + 2, 10, "runs after resume")

    job_id = cli("run-now", "hourly").strip().rsplit(" ", 1)[-1]
    wait_for(lambda: any(r["id"] == job_id for r in runs(rec, "hourly")), 10, "the run-now job")
    wait_for(lambda: entry("hourly")["last_outcome"] == "success", 10, "its outcome")
    hourly = entry("hourly")
    assert hourly["last_job_id"] == job_id and hourly["runs"] == 1 and hourly["last_due"] is None

    missing = celery_cli("-A", APP, "ext", "periodic", "pause", "nope", broker_url=broker_url,
                         env=env)
    assert missing.returncode == 1 and "no periodic job entry nope" in missing.stderr


def test_dashboard_page_and_api(app: Any, redis_server: Any, redis_client: redis.Redis) -> None:
    """The Periodic page and its API: entries with next and last run; pause, resume and
    run-now are POSTs that need the CSRF token, like every other action."""
    with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    from celery_ext.admin.web import create_app

    Periodic(app, redis_server.client(), Settings()).run_due()  # a leader recorded them
    client = Client.for_app(app)
    with TestClient(create_app(client, sample_interval=60)) as tc:
        page = tc.get("/periodic")
        assert page.status_code == 200 and "<h1>Periodic jobs</h1>" in page.text
        items = {e["name"]: e for e in tc.get("/api/periodic").json()["items"]}
        assert set(items) == {"every", "hourly"} and items["every"]["next_due"]
        assert tc.post("/api/periodic/pause", json={"name": "every"}).status_code == 403
        token = {"X-CSRF-Token": tc.get("/api/csrf").json()["csrf_token"]}
        r = tc.post("/api/periodic/pause", json={"name": "every"}, headers=token)
        assert r.json() == {"name": "every", "paused": True, "changed": True}
        assert tc.get("/api/periodic").json()["items"][0]["paused"] is True
        r = tc.post("/api/periodic/resume", json={"name": "every"}, headers=token)
        assert r.json()["changed"] is True
        r = tc.post("/api/periodic/run", json={"name": "hourly"}, headers=token)
        job_id = r.json()["job_id"]
        queued = redis_client.lrange(K.queue("tests.apps.proj_periodic.beat_tick"), 0, -1)
        assert [json.loads(p)["headers"]["id"] for p in queued] == [job_id]
        hourly = next(e for e in tc.get("/api/periodic").json()["items"]
                      if e["name"] == "hourly")
        assert hourly["last_job_id"] == job_id and hourly["last_outcome"] == "pending"
        r = tc.post("/api/periodic/run", json={"name": "nope"}, headers=token)
        assert r.status_code == 404
    client.client.close()


def test_periodic_signals_connect_when_the_transport_starts_not_at_import(
        broker_url: str) -> None:
    """Importing the package connects no signal; the transport's start (a worker's main
    process before it forks, ``celery beat`` before ``beat_init``) connects the outcome
    recorder and the beat warning, once however often it starts."""
    code = f"""
import celery_ext, celery_ext.transport, celery_ext.worker.periodic_leader as p
from celery.signals import beat_init, task_postrun
from kombu import Connection
def count():
    return (sum(r[1] is p._record_outcome for r in task_postrun.receivers),
            sum(r[1] is p._warn_beat for r in beat_init.receivers))
print(count())
for _ in range(2):
    Connection({broker_url!r}).transport
print(count())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(0,", "0)", "(1,", "1)"]
