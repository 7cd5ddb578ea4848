"""Periodic jobs (issue 14): the app's beat_schedule run by the worker pools, no celery beat.

Real server; the end-to-end tests run real ``celery worker`` subprocesses of
``tests.apps.proj_periodic`` (entry ``every``: each second; entry ``hourly``: a crontab that
does not fall due during a test). Schedule math is Celery's; the pure tests check that
we ask it the right question on the Redis clock.
"""

from __future__ import annotations

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
from celery_ext.worker.periodic_leader import Periodic
from tests.apps import proj
from tests.helpers import Factory, Mode, celery_cli, start_workers, wait_for

K = Keys("celery_ext")
APP = "tests.apps.proj_periodic"
#: Timings of the worker pools here: the requeuer lease is promote_interval + 1 s.
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
    every = schedule(timedelta(seconds=2.5), app=app)
    assert next_due_ms(every, at, tz) == at + 2500
    dues, following = due_times(every, at, at + 6000, tz)
    assert dues == [at, at + 2500, at + 5000] and following == at + 7500
    dues, following = due_times(every, at, at + 3_600_000, tz, limit=4)
    assert len(dues) == 4 and following == at + 3_600_000 + 2500  # the rest jumped over


def test_late_runs_each_run_and_missed_ones_follow_the_policy() -> None:
    dues, now = [1000, 2000, 3000], 3500
    each = [Step(1000, 1000, 2000, 0, True), Step(2000, 2000, 3000, 0, True),
            Step(3000, 3000, 4000, 0, True)]
    assert plan(dues, 4000, now, grace_ms=5000, policy="once") == each
    assert plan(dues, 4000, now + 5000, grace_ms=5000, policy="all") == each
    assert plan(dues, 4000, now + 5000, grace_ms=5000, policy="once") == \
        [Step(1000, 3000, 4000, 2, True)]
    assert plan(dues, 4000, now + 5000, grace_ms=5000, policy="skip") == \
        [Step(1000, 3000, 4000, 3, False)]
    assert plan(dues, 4000, now, grace_ms=5000, policy="once", paused=True) == \
        [Step(1000, 3000, 4000, 3, False)]
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
    is pushed once. After an outage longer than the grace, one run stands for all."""
    settings = Settings(periodic_grace=10.0)
    leaders = [Periodic(app, redis_server.client(), settings) for _ in range(4)]
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

    redis_client.delete(K.queue(queue))
    now = now_ms(redis_client)
    # All pools were down for 20 s (due times half a second off the ones run above: a
    # due time already run as the entry's last run would not be pushed again).
    redis_client.hset(K.periodic_entry(name), "next_due", now - 20_500)
    leaders[1].run_due()
    (due,) = _queued_dues(redis_client, queue)  # policy "once": one run for 20-21 due times
    assert now - 1000 <= due <= now + 5000 and (due - now) % 1000 == 500
    every = next(e for e in Client(redis_client).periodic() if e["name"] == name)
    assert every["missed"] >= 19 and every["last_due"] == due / 1000


# -- real worker pools ----------------------------------------------------------------------
def test_three_pools_leader_killed_every_due_time_enqueued_once(
        worker_factory: Factory, broker_url: str, redis_client: redis.Redis,
        rec: redis.Redis) -> None:
    """Three pools, a 1-second entry for about 20 s; the leading pool is SIGKILLed midway.
    Every due time from the first run to the last is enqueued exactly once, and none
    later than the lease bound (promote_interval + 1 s, plus a follower's pass) + 1 s."""
    proj.configure(broker_url)
    rec.delete("runs:every")
    workers = start_workers(worker_factory, 3, APP, env=FAST)

    def leader() -> Any:
        found = [w for w in workers if w.alive and LEADS in w.log_text()]
        return found[0] if len(found) == 1 else None

    first = wait_for(leader, 20, "a leading pool")
    wait_for(lambda: len(runs(rec, "every")) >= 8, 30, "8 runs")
    first.stop(signal.SIGKILL, timeout=5)  # the whole pool, main process and children
    killed_at = time.time()
    wait_for(lambda: leader() not in (None, first), 20, "a new leader")
    wait_for(lambda: sum(r["started"] > killed_at + 6 for r in runs(rec, "every")) >= 3, 30,
             "runs after the failover")
    for w in workers:
        if w is not first:
            w.stop(timeout=15)
    got = runs(rec, "every")
    by_due: dict[int, set[str]] = {}
    for r in got:
        by_due.setdefault(r["due"], set()).add(r["id"])
    # Runs the last pools enqueued while they stopped wait in the queue, not run.
    left = _queued_dues(redis_client, "tests.apps.proj_periodic.beat_tick")
    assert not set(left) & set(by_due)
    for due in left:
        by_due[due] = {run_id("celery_ext", "every", due)}
    dues = sorted(by_due)
    assert dues == list(range(dues[0], dues[-1] + 1, 1000)), "a due time was skipped"
    assert all(ids == {run_id("celery_ext", "every", d)} for d, ids in by_due.items())
    state = next(e for e in Client(redis_client).periodic() if e["name"] == "every")
    assert state["runs"] == len(dues), "a due time was pushed twice"
    assert state["missed"] == 0
    bound = (0.5 + 1) + 0.5 + 1.0
    late = {r["due"]: r["enqueued_at"] - r["due"] / 1000 for r in got}
    assert max(late.values()) <= bound, late
    assert any(lag > 0.5 for lag in late.values()), "no run waited for the failover"


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
