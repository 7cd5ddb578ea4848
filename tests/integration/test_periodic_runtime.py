"""Periodic entries set at runtime (issue 37): stored in Redis, run by the worker pools'
leader beside the app's beat_schedule, changed and removed with no deploy.

Real server; the end-to-end tests run real ``celery worker`` subprocesses of
``tests.apps.proj_periodic`` (its config entry ``every`` set to an hour here, so only the
entries a test sets run) in both modes and both pool kinds. Races between leaders run
several :class:`Periodic` passes at once in this process against the same server.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import warnings
from typing import Any

import pytest
import redis

from celery_ext.client import Client, InvalidPeriodicEntry
from celery_ext.config import Settings
from celery_ext.options.periodic_schedule import spec
from celery_ext.producer.periodic_run import run_id
from celery_ext.store.clock import now_ms
from celery_ext.store.keys import Keys
from celery_ext.worker.periodic_leader import Periodic
from tests.apps import proj
from tests.helpers import Factory, Mode, celery_cli, start_workers, wait_for

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
APP = "tests.apps.proj_periodic"
TASK = "tests.apps.proj_periodic.beat_tick"
#: Worker timings: the leader passes at least twice a second; its config entry ``every``
#: falls due once an hour (not during a test).
ENV = {"CELERY_EXT_PROMOTE_INTERVAL": "0.5", "CELERY_EXT_HEARTBEAT_INTERVAL": "0.5",
       "CELERY_EXT_DEAD_AFTER": "1.5", "CELERY_EXT_REAP_INTERVAL": "0.5",
       "TEST_PERIODIC_EVERY": "3600"}


def runs(rec: redis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(v) for v in rec.lrange(f"runs:{key}", 0, -1)]


def entry(client: Client, name: str) -> Any:
    return next((e for e in client.periodic() if e["name"] == name), None)


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_periodic

    return proj_periodic.app


# -- bad input: one error, nothing stored -----------------------------------------------------
BAD = [
    ({"every": 5, "crontab": "* * * * *"}, "exactly one schedule"),
    ({}, "exactly one schedule"),
    ({"every": 0.5}, "at least 1 second"),
    ({"every": "often"}, "number of seconds"),
    ({"crontab": "0 0 30 2 *"}, "never fires"),  # Feb 30
    ({"crontab": "0 0 * *"}, "five fields"),
    ({"crontab": "61 * * * *"}, "never fires or cannot be read"),
    ({"every": 5, "task": "tests.apps.proj_periodic.no_such_task"}, "unknown task"),
    ({"every": 5, "args": {"a": 1}}, "args must be a list"),
]


@pytest.mark.parametrize(("given", "said"), BAD)
def test_bad_input_is_one_value_error_and_nothing_is_stored(
        app: Any, redis_client: redis.Redis, given: dict[str, Any], said: str) -> None:
    """The client (with the app, so the task name is checked against its registry)
    raises one ``ValueError`` subclass naming what to change, and stores nothing."""
    client = Client.for_app(app)
    kw = {"task": TASK, **given}
    with pytest.raises(InvalidPeriodicEntry, match=said) as info:
        client.set_periodic("bad", **kw)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    assert not redis_client.exists(K.periodic_runtime)
    assert entry(client, "bad") is None
    client.client.close()


def test_without_an_app_a_task_name_must_be_a_dotted_identifier(
        redis_client: redis.Redis) -> None:
    """No app at hand (``Client.from_url``): any dotted name is taken, nothing else."""
    client = Client(redis_client)
    with pytest.raises(InvalidPeriodicEntry, match="task must be a task name"):
        client.set_periodic("x", "not a task; rm -rf", every=5)
    assert not redis_client.exists(K.periodic_runtime)
    assert client.set_periodic("x", "some.other.service.task", every=5) is True
    assert entry(client, "x")["source"] == "runtime"


def test_api_and_cli_refuse_bad_input_with_400_and_exit_2(
        app: Any, broker_url: str, redis_client: redis.Redis) -> None:
    """The JSON API answers 400 with the same message, and ``celery ext periodic set``
    exits with status 2; neither stores anything. A good entry set through each is
    listed with its source, and removed through each."""
    with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    from celery_ext.admin.web import create_app

    client = Client.for_app(app)
    with TestClient(create_app(client, sample_interval=60)) as tc:
        good = {"name": "api", "task": TASK, "every": 30, "args": ["api"], "queue": "q1"}
        assert tc.post("/api/periodic/entries", json=good).status_code == 403  # no CSRF
        token = {"X-CSRF-Token": tc.get("/api/csrf").json()["csrf_token"]}
        for given, said in BAD:
            r = tc.post("/api/periodic/entries", json={"name": "bad", "task": TASK, **given},
                        headers=token)
            assert r.status_code == 400 and said in r.json()["error"], (given, r.text)
        assert tc.post("/api/periodic/entries", json={"name": "bad", "task": TASK, "every": 5,
                                                      "queue": 7}, headers=token).status_code == 400
        assert not redis_client.exists(K.periodic_runtime)
        r = tc.post("/api/periodic/entries", json=good, headers=token)
        assert r.status_code == 201 and r.json() == {"name": "api", "created": True}
        r = tc.post("/api/periodic/entries", json={**good, "every": 60}, headers=token)
        assert r.status_code == 200 and r.json()["created"] is False
        items = {e["name"]: e for e in tc.get("/api/periodic").json()["items"]}
        assert items["api"]["source"] == "runtime" and items["api"]["schedule"] == "every 60s"
        record = json.loads(redis_client.hget(K.periodic_runtime, "api") or "")
        assert record["options"] == {"queue": "q1"} and record["args"] == ["api"]
        job_id = tc.post("/api/periodic/run", json={"name": "api"}, headers=token).json()["job_id"]
        assert entry(client, "api")["last_job_id"] == job_id  # run-now of a runtime entry
        assert tc.delete("/api/periodic/entries/api").status_code == 403
        assert tc.delete("/api/periodic/entries/api", headers=token).json() == \
            {"name": "api", "removed": True}
        assert tc.delete("/api/periodic/entries/api", headers=token).status_code == 404
        page = tc.get("/periodic")
        assert page.status_code == 200 and "set at runtime" in page.text
    client.client.close()

    def cli(*args: str) -> Any:
        return celery_cli("-A", APP, "ext", "periodic", *args, broker_url=broker_url,
                          env={"TEST_PERIODIC_EVERY": "3600"})

    for args, said in [(("--every", "0.2"), "at least 1 second"),
                       (("--crontab", "0 0 31 4 *"), "never fires"),
                       (("--every", "5", "--crontab", "* * * * *"), "exactly one schedule"),
                       (("--every", "5", "--args", "[1,"), "--args is not JSON")]:
        done = cli("set", "bad", TASK, *args)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr)
    done = cli("set", "bad", "tests.apps.proj_periodic.missing", "--every", "5")
    assert done.returncode == 2 and "unknown task" in done.stderr
    assert not redis_client.exists(K.periodic_runtime)
    done = cli("set", "cli", TASK, "--crontab", "*/5 * * * *", "--args", '["cli"]',
               "--kwargs", "{}", "--queue", "q2")
    assert done.returncode == 0 and "created cli" in done.stdout, done.stderr
    listed = {e["name"]: e for e in json.loads(cli("ls", "--json").stdout)}
    assert listed["cli"]["source"] == "runtime"
    assert listed["cli"]["schedule"] == "crontab(*/5 * * * *)"
    assert "runtime" in cli("ls").stdout
    assert "removed cli" in cli("remove", "cli").stdout
    gone = cli("remove", "cli")
    assert gone.returncode == 1 and "no runtime periodic job entry cli" in gone.stderr
    assert not redis_client.hexists(K.periodic_runtime, "cli")


def test_a_broken_stored_record_is_skipped_with_one_log_line(
        app: Any, redis_server: Any, redis_client: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    """A record written by hand that the one check refuses is skipped by the leader (one
    log line however many passes), while the other entries run; the listing says why."""
    client = Client(redis_client)
    client.set_periodic("fine", TASK, every=1, args=["fine"])
    for name, raw in (("not-json", "{"), ("too-fast", json.dumps({"task": TASK, "every": 0.1})),
                      ("no-schedule", json.dumps({"task": TASK}))):
        redis_client.hset(K.periodic_runtime, name, raw)
        redis_client.sadd(K.periodic, name)
    leader = Periodic(app, redis_server.client(), Settings(periodic_grace=10.0))
    with caplog.at_level(logging.ERROR, logger="celery_ext.worker.periodic_leader"):
        for _ in range(3):
            leader.run_due()
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 3, skipped
    assert set(leader.entries) == {"every", "hourly", "fine"}
    redis_client.hset(K.periodic_entry("fine"), "next_due", now_ms(redis_client) - 10)
    leader.run_due()
    assert entry(client, "fine")["runs"] == 1
    rows = {e["name"]: e for e in client.periodic()}
    assert "broken" in (rows["too-fast"]["error"] or "")
    assert rows["too-fast"]["source"] == "runtime" and rows["too-fast"]["runs"] == 0


# -- leaders racing on a changed entry --------------------------------------------------------
def _queued(client: redis.Redis, name: str = "tick") -> list[dict[str, Any]]:
    """The headers of the runs of entry ``name`` waiting in their job queue, oldest first
    (the app's own entries run beside them in this process)."""
    headers = [json.loads(p)["headers"] for p in client.lrange(K.queue(TASK), 0, -1)]
    return [h for h in reversed(headers) if h.get("celery_ext_periodic") == name]


def test_a_leader_that_read_the_old_entry_does_not_write_it_back(
        app: Any, redis_server: Any, redis_client: redis.Redis) -> None:
    """A leader stalled between its read of the runtime entries and its write (a slow
    pass, a failover) while the entry changes: its sync of the old schedule is refused,
    so the new schedule's next due time stands and no run of the old one is written."""
    client = Client(redis_client)
    client.set_periodic("tick", TASK, every=1, args=["tick"])
    first = Periodic(app, redis_server.client(), Settings())
    first.run_due()
    stall, go = threading.Event(), threading.Event()

    class Stalls:
        """The stalled leader's client: it stops after reading the runtime entries."""

        def __init__(self, real: redis.Redis) -> None:
            self.real = real

        def __getattr__(self, attr: str) -> Any:
            return getattr(self.real, attr)

        def hgetall(self, key: str) -> Any:
            reply = self.real.hgetall(key)
            if key == K.periodic_runtime and not stall.is_set():
                stall.set()
                assert go.wait(10)
            return reply

    stalled = Periodic(app, Stalls(redis_server.client()), Settings())  # type: ignore[arg-type]
    stalled.synced = True  # it led before its stall
    thread = threading.Thread(target=stalled.run_due)
    thread.start()
    assert stall.wait(10)
    client.set_periodic("tick", TASK, every=60, args=["tick"])
    fresh = Periodic(app, redis_server.client(), Settings())
    fresh.run_due()
    new_spec = spec(fresh.entries["tick"], app.timezone)
    state = redis_client.hmget(K.periodic_entry("tick"), "spec", "next_due")
    go.set()
    thread.join(10)
    assert redis_client.hmget(K.periodic_entry("tick"), "spec", "next_due") == state
    assert state[0] == new_spec.encode()
    assert int(state[1] or 0) - now_ms(redis_client) > 50_000  # a minute away, not a second
    assert not _queued(redis_client)


def test_a_run_planned_before_a_removal_is_not_written_after_it(
        app: Any, redis_server: Any, redis_client: redis.Redis) -> None:
    """A leader stalled between planning a due run and writing it while the entry is
    removed: its write finds the entry's spec gone (``next_due`` alone still matches)
    and pushes nothing."""
    client = Client(redis_client)
    client.set_periodic("tick", TASK, every=1, args=["tick"])
    leader = Periodic(app, redis_server.client(), Settings(periodic_grace=10.0))
    leader.run_due()
    redis_client.hset(K.periodic_entry("tick"), "next_due", now_ms(redis_client) - 10)
    stall, go = threading.Event(), threading.Event()

    class Stalls:
        """The leader's publisher: it stops before its first write."""

        def __init__(self, real: Any) -> None:
            self.real = real

        def apply_async(self, *args: Any, **kw: Any) -> Any:
            stall.set()
            assert go.wait(10)
            return self.real.apply_async(*args, **kw)

    leader.scheduler = Stalls(leader.scheduler)  # type: ignore[assignment]
    thread = threading.Thread(target=leader.run_due)
    thread.start()
    assert stall.wait(10)
    assert client.remove_periodic("tick") is True
    go.set()
    thread.join(10)
    assert not _queued(redis_client)
    assert int(redis_client.hget(K.periodic_entry("tick"), "runs") or 0) == 0


def test_racing_leaders_on_a_changed_entry_run_each_due_time_once(
        app: Any, redis_server: Any, redis_client: redis.Redis) -> None:
    """Four leaders pass over one entry at once, again and again, while its interval
    changes from 1 to 2 seconds: each due time is pushed once (one job id each), runs
    before the change are a second apart, runs after it two seconds apart, and the
    entry counts exactly the runs pushed."""
    client = Client(redis_client)
    client.set_periodic("tick", TASK, every=1, args=["tick"])
    leaders = [Periodic(app, redis_server.client(), Settings(periodic_grace=10.0,
                                                             periodic_missed="all"))
               for _ in range(4)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def lead(p: Periodic) -> None:
        try:
            while not stop.is_set():
                p.run_due()
                time.sleep(0.02)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=lead, args=(p,)) for p in leaders]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(_queued(redis_client)) >= 3, 10, "three runs a second apart")
        client.set_periodic("tick", TASK, every=2, args=["tick"])
        changed = now_ms(redis_client)
        wait_for(lambda: sum(h["celery_ext_due"] > changed for h in _queued(redis_client)) >= 3,
                 15, "three runs two seconds apart")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    headers = _queued(redis_client)
    dues = [h["celery_ext_due"] for h in headers]
    assert len(dues) == len(set(dues)), "a due time was pushed twice"
    assert [h["id"] for h in headers] == [run_id("celery_ext", "tick", d) for d in dues]
    before = sorted(d for d in dues if d <= changed)
    after = sorted(d for d in dues if d > changed)
    assert all(b - a == 1000 for a, b in itertools.pairwise(before)), before
    assert all(b - a == 2000 for a, b in itertools.pairwise(after)), after
    assert after[0] - changed <= 2000 + 600  # the new cadence from the leaders' next pass
    assert entry(client, "tick")["runs"] == len(dues)
    assert entry(client, "tick")["schedule"] == "every 2s"


# -- real worker pools ------------------------------------------------------------------------
def _stop_all(workers: list[Any]) -> None:
    stoppers = [threading.Thread(target=w.stop, kwargs={"timeout": 20}) for w in workers]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()


@pytest.mark.parametrize(("mode", "first", "then"),
                         [("install", "prefork", "threads"), ("dropin", "threads", "prefork")])
def test_an_entry_set_changed_and_removed_at_runtime_outlives_every_pool(
        worker_factory: Factory, broker_url: str, redis_client: redis.Redis, rec: redis.Redis,
        mode: str, first: str, then: str) -> None:
    """With no deploy: an entry set through the client runs every second; changed to
    every 2 seconds it runs at the new cadence from the next due time; a runtime entry
    named like the app's entry ``every`` wins over it, and the app's entry is back
    when it is removed. Every pool stops and a pool of the other kind starts: the entry
    runs on. Removed, it runs no more. Each due time runs once."""
    rec.delete("runs:rt", "runs:every-rt", "runs:every")
    env = Mode(mode, broker_url).env(**ENV)
    workers = start_workers(worker_factory, 2, APP, pool=first, concurrency=2, env=env)
    client = Client(redis_client)  # no app at hand: a script of the operator's
    assert client.set_periodic("rt", TASK, every=1, args=["rt"]) is True
    wait_for(lambda: len(runs(rec, "rt")) >= 3, 30, "three runs a second apart")
    assert client.set_periodic("rt", TASK, every=2, args=["rt"]) is False
    changed = now_ms(redis_client)
    wait_for(lambda: sum(r["due"] > changed for r in runs(rec, "rt")) >= 2, 30,
             "two runs two seconds apart")
    assert entry(client, "rt")["schedule"] == "every 2s"

    client.set_periodic("every", TASK, every=1, args=["every-rt"])
    wait_for(lambda: len(runs(rec, "every-rt")) >= 2, 30, "the runtime `every` runs")
    assert entry(client, "every")["source"] == "runtime" and not runs(rec, "every")

    _stop_all(workers)
    restarted = time.time()
    start_workers(worker_factory, 1, APP, pool=then, concurrency=2, env=env)
    wait_for(lambda: sum(r["enqueued_at"] > restarted for r in runs(rec, "rt")) >= 2, 30,
             "runs after every pool restarted")

    assert client.remove_periodic("every") is True
    wait_for(lambda: (entry(client, "every") or {}).get("source") == "config", 10,
             "the app's entry `every` back")
    assert entry(client, "every")["schedule"] == "every 3600s"
    assert client.remove_periodic("every") is False  # the app's entry is the app's
    assert client.remove_periodic("rt") is True
    removed = time.time()
    assert entry(client, "rt") is None
    time.sleep(3.0)
    got = runs(rec, "rt")
    assert not [r for r in got if r["enqueued_at"] > removed + 0.2], "ran after its removal"
    assert not runs(rec, "every")  # the app's hourly-ish entry did not fall due

    dues = sorted(r["due"] for r in got)
    assert len(dues) == len(set(dues)), "a due time ran twice"
    assert all(r["id"] == run_id("celery_ext", "rt", r["due"]) for r in got)
    before = [d for d in dues if d <= changed]
    after = [d for d in dues if d > changed]
    assert all(b - a == 1000 for a, b in itertools.pairwise(before)), before
    # Two seconds apart, or a multiple when the restart's missed due times had one run.
    assert all((b - a) % 2000 == 0 for a, b in itertools.pairwise(after)), after
    assert after[0] - changed <= 2000 + 1500, (after[0] - changed)


def test_a_pool_whose_app_has_no_beat_schedule_runs_runtime_entries(
        worker_factory: Factory, broker_url: str, redis_client: redis.Redis,
        rec: redis.Redis) -> None:
    """A runtime entry needs no ``beat_schedule`` in any app: a threads pool of an app
    without one leads and runs it."""
    proj.configure(broker_url)
    rec.delete("runs:plain")
    start_workers(worker_factory, 1, "tests.apps.proj", pool="threads", concurrency=2,
                  env=Mode("install", broker_url).env(**ENV))
    Client.for_app(proj.app).set_periodic("plain", proj.record.name, every=1, args=["plain"])
    wait_for(lambda: rec.llen("runs:plain") >= 3, 30, "three runs")
    assert entry(Client(redis_client), "plain")["runs"] >= 3


def test_runtime_entries_on_a_cluster(app: Any, cluster_url: str) -> None:
    """On a cluster the runtime records, the index and the entries' state share the home
    slot: set and remove are one MULTI there, and the leader's sync reads the records in
    its script."""
    import uuid

    cc = Client.from_url(cluster_url, cluster=True, namespace=f"rt_{uuid.uuid4().hex[:8]}")
    try:
        assert cc.set_periodic("tick", TASK, every=60, args=["tick"]) is True
        leader = Periodic(app, cc.client, cc.settings, entries={})
        leader.run_due()  # nothing due for a minute: records the entry only
        state = cc.client.hgetall(cc.keys.periodic_entry("tick"))
        assert state[b"source"] == b"runtime" and int(state[b"next_due"]) > now_ms(cc.client)
        assert [e["source"] for e in cc.periodic()] == ["runtime"]
        assert cc.remove_periodic("tick") is True
        assert cc.periodic() == [] and not cc.client.exists(cc.keys.periodic_runtime)
        assert cc.client.hget(cc.keys.periodic_entry("tick"), "spec") == b""
    finally:
        cc.client.close()
