"""Worker pools: heartbeats, reaper, busy workers, checkin, poison pills (issue 3).

Real server, real ``celery worker`` subprocesses, timings shrunk through the
``CELERY_EXT_*`` environment variables (the one place timings live). Tests taking the
``mode`` fixture run twice: with ``install(app)`` and drop-in (only the broker URL
changed; a stock Celery app sends to the ``celery`` queue).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_ext.admin.overview import State
from celery_ext.client import Client
from celery_ext.config import Settings
from celery_ext.store.keys import Keys
from celery_ext.store.liveness import queues_of
from celery_ext.worker.heartbeater import Heartbeater
from celery_ext.worker.reaper import Reaper
from tests.apps import proj
from tests.helpers import Mode, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

FAST = {
    "CELERY_EXT_HEARTBEAT_INTERVAL": "0.25",
    "CELERY_EXT_DEAD_AFTER": "1.5",
    "CELERY_EXT_REAP_INTERVAL": "0.5",
}
SETTINGS = Settings.load({}, environ=FAST)
KEYS = Keys(SETTINGS.namespace)
APP = "tests.apps.proj_pools"


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_pools

    return proj_pools


def start_worker(factory: Callable[..., WorkerProcess], **kw: Any) -> WorkerProcess:
    env = {**FAST, **kw.pop("env", {})}
    return factory(APP, env=env, **kw).start()


def runs(rec: redis.Redis, key: str) -> list[str]:
    return [v.decode() for v in rec.lrange(f"runs:{key}", 0, -1)]


def starts(rec: redis.Redis, key: str) -> list[str]:
    return [v.decode() for v in rec.lrange(f"start:{key}", 0, -1)]


def inflight(client: redis.Redis) -> int:
    """Jobs in every registered pool's in-flight record."""
    return sum(client.hlen(KEYS.inflight(p.decode())) for p in client.zrange(KEYS.pools, 0, -1))


def pools(client: redis.Redis) -> dict[str, float]:
    return {k.decode(): s for k, s in client.zrange(KEYS.pools, 0, -1, withscores=True)}


@pytest.mark.parametrize(("mode", "pool"), [("install", "prefork"), ("dropin", "prefork"),
                                            ("dropin", "gevent")], indirect=["mode"])
def test_pool_registers_and_heartbeats_with_redis_time(app: Any, mode: Mode, pool: str,
                                                       worker_factory: Any,
                                                       redis_client: redis.Redis) -> None:
    w = start_worker(worker_factory, pool=pool, concurrency=2, env=mode.env())
    pool_id = wait_for(lambda: next(iter(pools(redis_client)), None), 10, "pool registration")
    info = wait_for(lambda: (h := redis_client.hgetall(KEYS.pool(pool_id))) and b"node" in h and h,
                    10, "pool details from the bootstep")
    assert info[b"concurrency"] == b"2"
    assert info[b"pool_type"] == pool.encode()
    assert str(w.pid).encode() == info[b"pid"]
    consumed = queues_of(info)  # written by the channel, in drop-in mode too
    assert consumed is not None, info
    if mode.dropin:  # Celery's default queue only: no install(app), no job queue per task
        assert consumed == ["celery"]
    else:
        assert "tests.apps.proj_pools.slow" in consumed
    first = pools(redis_client)[pool_id]
    second = wait_for(lambda: (s := pools(redis_client).get(pool_id, 0)) > first and s, 5,
                      "a second heartbeat")
    t_s, t_us = redis_client.time()
    assert abs((t_s * 1000 + t_us // 1000) - second) < 2000  # stamped with Redis time
    w.stop()
    assert pools(redis_client) == {}  # warm shutdown deregisters
    # ... after its "stopping" (written from a thread of its own: bootsteps.begin_stopping),
    # which leaves no pool record behind
    assert not redis_client.exists(KEYS.pool(pool_id))


def test_sigkill_main_process_jobs_rerun_elsewhere(app: Any, mode: Mode, worker_factory: Any,
                                                   redis_client: redis.Redis,
                                                   rec: redis.Redis) -> None:
    """Drop-in: the jobs the victim was running come back only if they were not acked
    when they started: the drop-in app sets Celery's own ``task_acks_late`` (and
    ``task_reject_on_worker_lost``), as ``install(app)`` does by default."""
    env = mode.env(acks_late=True)
    victim = start_worker(worker_factory, pool="prefork", concurrency=2, hostname="a@%h",
                          env=env)
    # The victim alone takes the jobs (8 = its prefetch, 12 s of work for its 2
    # children); the survivor starts once it runs one, with nothing left to take, and
    # is idle when the victim dies.
    keys = [f"k{i}" for i in range(8)]
    for k in keys:
        mode.send(app.slow, k, 3.0)
    victim_pid = str(victim.pid)
    victim_children = set(map(str, victim.child_pids()))
    wait_for(lambda: any(s.split(":")[0] in victim_children
                         for k in keys for s in starts(rec, k)), 10, "victim running a job")
    survivor = start_worker(worker_factory, pool="threads", concurrency=4, hostname="b@%h",
                            env=env)
    kill_at = time.time()
    children = victim.child_pids()
    victim.kill()
    for pid in children:  # the whole host died: its children too
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: all(runs(rec, k) for k in keys), 30, "every job to complete")
    # Jobs the victim was running are rerun by the survivor within dead_after + reap + 1 s.
    victim_keys = [k for k in keys
                   if any(s.split(":")[0] in victim_children for s in starts(rec, k))]
    reruns = [float(s.split(":")[1]) for k in victim_keys for s in starts(rec, k)
              if float(s.split(":")[1]) > kill_at]
    assert reruns, "expected some of the victim's jobs to be rerun"
    # Spec: kill -> rerun within dead_after + reap interval (+20% jitter) + 1 s.
    limit = SETTINGS.dead_after + SETTINGS.reap_interval * 1.2 + 1.0
    print(f"kill -> first rerun {min(reruns) - kill_at:.2f}s (limit {limit:.2f}s)")
    assert min(reruns) - kill_at < limit, (min(reruns) - kill_at, limit)
    for k in keys:
        assert len(runs(rec, k)) >= 1
        assert len(starts(rec, k)) <= 2  # at most one extra run per in-flight job
    assert victim_pid not in {p.split(":")[1] for p in pools(redis_client)}
    wait_for(lambda: redis_client.scard(KEYS.inflight_pools) <= 1, 5, "orphan cleanup")
    running = {k: int(v) for k, v in redis_client.hgetall(KEYS.running).items()}
    wait_for(lambda: all(int(v) == 0 for v in redis_client.hgetall(KEYS.running).values()),
             10, f"running counts back to 0 (now {running})")
    survivor.stop()


def test_sigkill_prefork_child_reruns_promptly(app: Any, mode: Mode, worker_factory: Any,
                                               redis_client: redis.Redis,
                                               rec: redis.Redis) -> None:
    """Drop-in: a job whose child died is requeued only with Celery's own
    ``task_acks_late`` and ``task_reject_on_worker_lost`` (``install(app)`` defaults
    them): the drop-in app sets them here."""
    w = start_worker(worker_factory, pool="prefork", concurrency=2,
                     env=mode.env(acks_late=True))
    mode.send(app.slow, "child", 3.0)
    first = wait_for(lambda: starts(rec, "child"), 10, "job start")[0]
    child_pid = int(first.split(":")[0])
    killed_at = time.time()
    os.kill(child_pid, signal.SIGKILL)
    wait_for(lambda: len(starts(rec, "child")) >= 2, 15, "the job to rerun")
    # Billiard notices a dead child within a few seconds; the job is then requeued at
    # once by the pool itself (it stays alive, so the reaper would never touch it).
    assert time.time() - killed_at < 12
    log = w.log_text()
    lost_at = log.index("WorkerLostError")
    assert "received" in log[lost_at:]
    wait_for(lambda: runs(rec, "child"), 15, "the rerun to finish")
    assert w.alive
    # The job records its run before it returns; the pool acks it just after.
    wait_for(lambda: int(redis_client.hget(KEYS.running, mode.queue(app.slow)) or 0) == 0,
             5, "the rerun's ack")


def test_killed_prefork_child_leaves_no_busy_record_or_checkin(
        app: Any, mode: Mode, worker_factory: Any, redis_client: redis.Redis,
        rec: redis.Redis) -> None:
    """A prefork child SIGKILLed mid-job cannot clear its busy record and checkin: the
    pool's main process drops them when Celery reports the loss, with ``install(app)``
    (the job is requeued and reruns) and drop-in with Celery's default ack settings
    (Celery fails the job). Drop-in leaves Celery's ack settings alone here on purpose:
    it is the path where Celery reports the loss as a task failure."""
    w = start_worker(worker_factory, pool="prefork", concurrency=2, env=mode.env())
    (pool_id,) = wait_for(lambda: list(pools(redis_client)), 10, "pool registration")
    state = State(redis_client, SETTINGS)
    job = mode.send(app.checkin_once, "lost", 60)
    first = wait_for(lambda: starts(rec, "lost"), 10, "job start")[0]
    wait_for(lambda: redis_client.hget(KEYS.checkins, job.id), 10, "its checkin")
    wait_for(lambda: [b for b in state.busy_workers() if b["job_id"] == job.id], 10,
             "its busy record")
    os.kill(int(first.split(":")[0]), signal.SIGKILL)
    wait_for(lambda: "WorkerLostError" in w.log_text() or runs(rec, "lost"), 20,
             "Celery reporting the lost child")
    if not mode.dropin:
        wait_for(lambda: runs(rec, "lost"), 15, "the rerun (it does not check in)")
    wait_for(lambda: redis_client.hget(KEYS.checkins, job.id) is None, 5,
             "the dead child's checkin to be dropped")
    assert redis_client.hlen(KEYS.busy(pool_id)) == 0
    assert not state.busy_workers()
    assert Client(redis_client, SETTINGS).job(job.id)["state"] != "running"
    assert w.alive and list(pools(redis_client)) == [pool_id]


def test_long_job_checks_in_and_is_never_duplicated(app: Any, mode: Mode, worker_factory: Any,
                                                    redis_client: redis.Redis,
                                                    rec: redis.Redis) -> None:
    start_worker(worker_factory, pool="prefork", concurrency=2, hostname="a@%h",
                 env=mode.env())
    start_worker(worker_factory, pool="prefork", concurrency=2, hostname="b@%h",
                 env=mode.env())
    duration = SETTINGS.dead_after * 3
    result = mode.send(app.long_checkin, "long", duration)
    state = State(redis_client, SETTINGS)
    # The busy record appears once the job has run BUSY_RECORD_DELAY; checkins at once.
    (busy,) = wait_for(lambda: [b for b in state.busy_workers()
                                if b["job_id"] == result.id and b["checkin_message"]],
                       10, "the busy record with a checkin")
    assert busy["job_name"] == "tests.apps.proj_pools.long_checkin"
    assert busy["checkin_message"].startswith("step ")
    assert 0 < busy["progress"] <= 1 and busy["args"].startswith("'long'")
    assert not busy["stalled"] and not busy["stop_requested"]
    assert result.get(timeout=duration + 15) == "long"
    assert len(starts(rec, "long")) == 1  # never duplicated while its pool lives
    wait_for(lambda: redis_client.hget(KEYS.checkins, result.id) is None, 5,
             "the checkin record to be cleared when the job ends")


@pytest.mark.parametrize("pool", ["threads", "solo", "gevent"])
def test_busy_record_and_checkin_from_threads_solo_and_gevent(app: Any, mode: Mode, pool: str,
                                                             worker_factory: Any,
                                                             redis_client: redis.Redis,
                                                             rec: redis.Redis) -> None:
    """The busy record and checkin are written by the process that runs the job: here
    the worker's main process (solo) or one of its threads (a greenlet under gevent:
    a patched thread), whose slot names it."""
    w = start_worker(worker_factory, pool=pool, concurrency=2, env=mode.env())
    (pool_id,) = wait_for(lambda: list(pools(redis_client)), 10, "pool registration")
    state = State(redis_client, SETTINGS)
    result = mode.send(app.long_checkin, "slot", 2)
    (busy,) = wait_for(lambda: [b for b in state.busy_workers()
                                if b["job_id"] == result.id and b["checkin_message"]],
                       10, "the busy record with a checkin")
    assert busy["pool_id"] == pool_id and busy["job_name"] == "tests.apps.proj_pools.long_checkin"
    assert busy["args"] == "'slot', 2" and busy["stall_after"] == 60
    pid, _, thread = busy["slot"].partition("-")
    assert pid == str(w.pid) and bool(thread) == (pool != "solo")
    assert result.get(timeout=20) == "slot"
    wait_for(lambda: not state.busy_workers() and
             redis_client.hget(KEYS.checkins, result.id) is None, 5,
             "the busy record and checkin cleared when the job ends")
    assert len(starts(rec, "slot")) == 1


@pytest.mark.parametrize(("mode", "pool"), [("install", "prefork"), ("dropin", "prefork"),
                                            ("install", "gevent")], indirect=["mode"])
def test_checkin_says_stop_on_warm_shutdown_and_unstarted_jobs_go_back(
        app: Any, mode: Mode, pool: str, worker_factory: Any, redis_client: redis.Redis,
        rec: redis.Redis) -> None:
    """A warm shutdown tells a checking-in job to stop, and every job the pool fetched
    but did not start waits in its queue again: none lost, none run twice, nothing in
    flight. Prefork reserves what it fetched and starts none of it after the signal.
    Under gevent the consumer itself waits for a free greenlet with one job in hand
    (Celery's ``Pool.spawn``), and Celery's loop turns once more after the signal: the
    jobs run then, once each."""
    w = start_worker(worker_factory, pool=pool, concurrency=1, env=mode.env())
    mode.send(app.long_checkin, "stopme", 60)
    wait_for(lambda: starts(rec, "stopme"), 10, "job start")
    keys = [f"held{i}" for i in range(3)]
    for k in keys:
        mode.send(app.slow, k, 0.0)
    queue = mode.queue(app.slow)
    client = Client(redis_client, SETTINGS)

    def queued() -> int:
        return {q["name"]: q["size"] for q in client.job_queues()}.get(queue, 0)

    wait_for(lambda: queued() < len(keys), 10, "the pool fetching jobs it cannot start yet")
    time.sleep(0.5)
    t0 = time.time()
    assert w.stop(signal.SIGTERM, timeout=20) == 0
    assert time.time() - t0 < 10
    assert rec.lrange("stopped:stopme", 0, -1), "checkin did not report the shutdown"
    started = [k for k in keys if starts(rec, k)]
    if pool == "prefork":
        assert started == []
    assert all(len(starts(rec, k)) == 1 for k in started)
    assert inflight(redis_client) == 0
    assert queued() == len(keys) - len(started)


def test_poison_job_lands_in_dead_set_others_keep_flowing(app: Any, mode: Mode,
                                                          worker_factory: Any,
                                                          redis_client: redis.Redis,
                                                          rec: redis.Redis) -> None:
    """Drop-in: a job that kills its child comes back (and is counted) only with
    Celery's own ``task_acks_late`` and ``task_reject_on_worker_lost`` (``install(app)``
    defaults them): the drop-in app sets them here."""
    w = start_worker(worker_factory, pool="prefork", concurrency=2,
                     env=mode.env(acks_late=True))
    mode.send(app.poison, "p")
    others = [mode.send(proj.add, i, i) for i in range(20)]
    assert [r.get(timeout=30) for r in others] == [2 * i for i in range(20)]
    wait_for(lambda: redis_client.zcard(KEYS.dead) == 1, 30, "the poison job in the dead set")
    starts_p = rec.lrange("start:p", 0, -1)
    assert len(starts_p) == SETTINGS.max_recoveries + 1
    (job_id,) = redis_client.zrange(KEYS.dead, 0, -1)
    meta = json.loads(redis_client.hget(KEYS.dead_jobs, job_id).decode().split("\n", 1)[0])
    assert meta["reason"] == "worker_lost"
    assert f"{SETTINGS.max_recoveries + 1} times" in meta["error"]
    assert mode.send(proj.add, 1, 1).get(timeout=10) == 2
    assert w.alive


def test_poison_job_killing_gevent_pools_lands_in_dead_set(app: Any, worker_factory: Any,
                                                            redis_client: redis.Redis,
                                                            rec: redis.Redis) -> None:
    """Under gevent a job that kills its process kills the whole pool, not a child: the
    reaper of another pool recovers it, each recovery counted, and past max_recoveries
    it goes to the dead set; the next gevent pool lives and runs jobs. (install(app):
    the poison job's queue of its own keeps the other jobs out of the dying pools, or
    they too would be recovered past max_recoveries.)"""
    settings = Settings.load({}, environ={**FAST, "CELERY_EXT_MAX_RECOVERIES": "1"})
    env = {"CELERY_EXT_MAX_RECOVERIES": "1"}
    poison_q = "tests.apps.proj_pools.poison"
    start_worker(worker_factory, pool="threads", concurrency=2, hostname="reaper@%h",
                 queues=["tests.apps.proj.add"], env=env)
    app.poison.delay("gp")
    for n in range(1, settings.max_recoveries + 2):
        victim = start_worker(worker_factory, pool="gevent", concurrency=50,
                              hostname=f"v{n}@%h", queues=[poison_q], env=env)
        wait_for(lambda v=victim: not v.alive, 20, f"gevent pool {n} to die of the poison job")
        assert len(rec.lrange("start:gp", 0, -1)) == n
    wait_for(lambda: redis_client.zcard(KEYS.dead) == 1, 10, "the poison job in the dead set")
    (job_id,) = redis_client.zrange(KEYS.dead, 0, -1)
    meta = json.loads(redis_client.hget(KEYS.dead_jobs, job_id).decode().split("\n", 1)[0])
    assert meta["reason"] == "worker_lost"
    assert f"{settings.max_recoveries + 1} times" in meta["error"]
    last = start_worker(worker_factory, pool="gevent", concurrency=50, hostname="last@%h",
                        env=env)
    assert [r.get(timeout=10) for r in [proj.add.delay(i, i) for i in range(20)]] \
        == [2 * i for i in range(20)]
    assert last.alive and len(rec.lrange("start:gp", 0, -1)) == settings.max_recoveries + 1


@pytest.mark.parametrize(("mode", "pool"), [("install", "solo"), ("dropin", "solo"),
                                            ("dropin", "gevent")], indirect=["mode"])
def test_sigstop_past_dead_after_then_sigcont(app: Any, mode: Mode, pool: str,
                                              worker_factory: Any, redis_client: redis.Redis,
                                              rec: redis.Redis) -> None:
    start_worker(worker_factory, pool="threads", concurrency=2, hostname="b@%h",
                 env=mode.env())
    sleeper = start_worker(worker_factory, pool=pool, hostname="a@%h", env=mode.env())
    keys = [f"s{i}" for i in range(6)]
    for k in keys:
        mode.send(app.slow, k, 0.5)
    time.sleep(0.3)
    os.kill(sleeper.pid, signal.SIGSTOP)
    try:
        time.sleep(SETTINGS.dead_after + SETTINGS.reap_interval * 2 + 1)
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)
    wait_for(lambda: all(runs(rec, k) for k in keys), 30, "every job to complete")
    assert sum(len(starts(rec, k)) for k in keys) <= len(keys) + 1 + 4  # bounded dupes
    # The stopped pool found out at its next heartbeat and registered again.
    wait_for(lambda: any(str(sleeper.pid) in p for p in pools(redis_client)), 10,
             "the revived pool to re-register")
    assert "declared dead" in sleeper.log_text()
    assert mode.send(proj.add, 2, 2).get(timeout=10) == 4


def test_two_reapers_requeue_each_job_once(redis_client: redis.Redis) -> None:
    """Reapers racing on one dead pool: the lock and the atomic script move each job once."""
    s = SETTINGS
    dead = Heartbeater(redis_client, s, "deadhost:1:aaaa")
    dead.register()
    tags = [f"t{i}" for i in range(50)]
    for t in tags:
        redis_client.hset(KEYS.inflight(dead.pool_id), t,
                          b"q\n" + json.dumps({"properties": {"delivery_tag": t}}).encode())
        redis_client.hincrby(KEYS.running, "q", 1)
    redis_client.sadd(KEYS.inflight_pools, dead.pool_id)
    redis_client.zadd(KEYS.pools, {dead.pool_id: 0})  # heartbeat long ago
    import threading

    results: list[Any] = []

    def run() -> None:
        r = Reaper(redis.Redis(connection_pool=redis_client.connection_pool), s)
        for _ in range(5):
            results.append(r.reap())

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    requeued = [tag for r in results for tag in r.requeued]
    assert sorted(requeued) == sorted(tags)  # each exactly once
    assert redis_client.llen(KEYS.queue("q")) == 50
    assert int(redis_client.hget(KEYS.running, "q")) == 0
    assert redis_client.zscore(KEYS.pools, dead.pool_id) is None
    assert not redis_client.sismember(KEYS.inflight_pools, dead.pool_id)
    assert all(int(redis_client.hget(KEYS.redelivery, t)) == 1 for t in tags)


def test_reaper_stall_guard_waits_for_steady_redis(redis_client: redis.Redis) -> None:
    """After a gap in its own contact with Redis the reaper does not judge staleness."""
    s = SETTINGS
    r = Reaper(redis_client, s)
    redis_client.zadd(KEYS.pools, {"other:1:bbbb": 0})
    assert r.tick() is None  # first contact: not steady yet
    r._last_ok = (r._last_ok or 0) - int((2 * s.reap_interval + 5) * 1000)  # a stall
    assert r.tick() is None and not r.steady()
    assert redis_client.zscore(KEYS.pools, "other:1:bbbb") is not None
    time.sleep(s.dead_after + 0.1)
    result = r.tick()
    assert result is not None and result.dead_pools == ["other:1:bbbb"]


def test_orphaned_inflight_records_are_requeued(redis_client: redis.Redis) -> None:
    orphan = "gone:2:cccc"
    redis_client.hset(KEYS.inflight(orphan), "t1", b'q\n{"properties": {}}')
    redis_client.sadd(KEYS.inflight_pools, orphan)
    result = Reaper(redis_client, SETTINGS).reap()
    assert result.requeued == ["t1"] and result.dead_pools == [orphan]
    assert redis_client.lrange(KEYS.queue("q"), 0, -1) == [b'{"properties": {}}']


def test_a_reaper_reads_each_pools_timings_once(redis_client: redis.Redis) -> None:
    """Every pool's reaper scans the registry each pass; reading each live pool's timings
    again on every pass made an idle pool's commands grow with the number of pools
    (bench.pools: 15 commands/s per pool at 200 pools, 13 of them HMGET)."""
    live = [Heartbeater(redis_client, SETTINGS, f"live:{i}:aaaa") for i in range(20)]
    for pool in live:
        pool.register()
        pool.heartbeat()
    reaper = Reaper(redis_client, SETTINGS)

    def hmgets() -> int:
        stats = redis_client.info("commandstats").get("cmdstat_hmget", {})
        return int(stats.get("calls", 0))

    before = hmgets()
    for _ in range(3):
        assert reaper.reap().dead_pools == []
        for pool in live:
            pool.heartbeat()
    assert hmgets() - before == 20  # the first pass read each pool once, the others none
    late = Heartbeater(redis_client, SETTINGS, "late:1:bbbb")
    late.register()
    late.heartbeat()
    before = hmgets()
    assert reaper.reap().dead_pools == []
    assert hmgets() - before == 1  # only the pool it had not seen
    redis_client.zadd(KEYS.pools, {"late:1:bbbb": 0})  # its heartbeat long ago
    assert reaper.reap().dead_pools == ["late:1:bbbb"]  # judged by the timings it read


@pytest.mark.parametrize(("mode", "pool"), [("install", "threads"), ("dropin", "threads"),
                                            ("install", "gevent")], indirect=["mode"])
def test_stop_request_and_stalled_jobs(app: Any, mode: Mode, pool: str, worker_factory: Any,
                                       redis_client: redis.Redis, rec: redis.Redis) -> None:
    start_worker(worker_factory, pool=pool, concurrency=2, env=mode.env())
    state = State(redis_client, SETTINGS)
    quiet = mode.send(app.quiet, "quiet", 3.0)  # never checks in; stall_after=1
    chatty = mode.send(app.long_checkin, "chatty", 30)
    wait_for(lambda: len(state.busy_workers()) == 2, 10, "both jobs running")
    state.request_stop(chatty.id)
    assert chatty.get(timeout=10) == "stopped"  # its next checkin returned True
    stalled = wait_for(lambda: [b for b in state.busy_workers() if b["stalled"]], 5,
                       "the silent job to be reported stalled")
    assert stalled[0]["job_id"] == quiet.id
    assert quiet.get(timeout=10) == "quiet"


def test_redis_outage_does_not_reap_live_pools(worker_factory: Any, tmp_path: Any) -> None:
    """Redis goes away for twice dead_after and comes back from its AOF: every
    heartbeat now looks stale at once, yet no live pool is reaped (each reaper waits
    until it has seen Redis answer steadily), and the job running across the outage
    completes exactly once. (install(app) only: the reaper's stall guard is the worker
    pool's, which the transport runs alike in both modes; a second run costs 15 s.)"""
    from celery_ext.testing.server import RedisServer

    with RedisServer(data_dir=tmp_path / "outage") as server:
        url = server.url(scheme="celery-ext")
        proj.configure(url)
        from tests.apps import proj_pools

        workers = [factory_start(worker_factory, url, f"{n}@%h") for n in ("a", "b")]
        client = server.client()
        job = proj_pools.slow.delay("through-outage", 2 * SETTINGS.dead_after + 2)
        wait_for(lambda: int(client.hget(KEYS.running, "tests.apps.proj_pools.slow") or 0) == 1,
                 10, "the job in flight")
        before = set(pools(client))
        client.close()
        server.kill()  # a crash: AOF (fsync always) keeps every acknowledged write
        time.sleep(SETTINGS.dead_after * 2)
        server.start()
        client = server.client()
        time.sleep(SETTINGS.dead_after * 2 + SETTINGS.reap_interval * 2)
        assert set(pools(client)) == before  # nobody was declared dead
        assert client.hlen(KEYS.redelivery) == 0  # nothing requeued
        assert job.get(timeout=30) == "through-outage"
        rec = redis.Redis.from_url(server.url(db=2))
        assert len(rec.lrange("start:through-outage", 0, -1)) == 1
        for w in workers:
            assert "declared dead" not in w.log_text()
            w.stop()


def factory_start(factory: Callable[..., WorkerProcess], url: str, name: str) -> WorkerProcess:
    return factory(APP, broker_url=url, env=dict(FAST), hostname=name, pool="threads",
                   concurrency=2).start()


def test_each_pool_is_judged_by_its_own_dead_after(app: Any, worker_factory: Any,
                                                   redis_client: redis.Redis) -> None:
    """Pools record their own dead_after and heartbeat interval when they register; a
    reaper started with other values judges each pool by the pool's own: a small
    dead_after does not reap a pool that heartbeats more slowly, a large one does not
    keep a stopped fast pool's jobs waiting. recover.lua's re-check agrees. (install(app)
    only: registration and reaping are the worker pool's, alike in both modes; drop-in
    registration: test_pool_registers_and_heartbeats_with_redis_time.)"""
    from celery_ext.store.clock import now_ms
    from celery_ext.worker.reaper import recover_tags

    slow = worker_factory(APP, pool="threads", concurrency=2, hostname="slow@%h", env={
        "CELERY_EXT_HEARTBEAT_INTERVAL": "1.5", "CELERY_EXT_DEAD_AFTER": "6",
        "CELERY_EXT_REAP_INTERVAL": "60"}).start()  # its own reaper stays out of the way
    fast = start_worker(worker_factory, pool="threads", concurrency=2, hostname="fast@%h",
                        env={"CELERY_EXT_REAP_INTERVAL": "60"})
    ids = wait_for(lambda: len(pools(redis_client)) == 2 and sorted(pools(redis_client)), 10,
                   "both pools registered")
    by_pid = {int(p.split(":")[1]): p for p in ids}
    slow_id, fast_id = by_pid[slow.pid], by_pid[fast.pid]
    assert redis_client.hmget(KEYS.pool(slow_id), ["dead_after_ms", "heartbeat_interval_ms"]) \
        == [b"6000", b"1500"]
    assert redis_client.hget(KEYS.pool(fast_id), "dead_after_ms") == b"1500"

    eager = Reaper(redis_client, Settings.load({}, environ={
        "CELERY_EXT_HEARTBEAT_INTERVAL": "0.1", "CELERY_EXT_DEAD_AFTER": "0.3"}))
    oldest = 0.0
    until = time.monotonic() + 2 * 1.5 + 0.5
    while time.monotonic() < until:
        oldest = max(oldest, (now_ms(redis_client) - pools(redis_client)[slow_id]) / 1000)
        assert eager.reap().dead_pools == []
        time.sleep(0.05)
    assert oldest > 0.3  # older than the eager reaper's dead_after, many times over
    # The script's re-check: a caller's deadline saying "stale" loses to the pool's own.
    done, _, _ = recover_tags(redis_client, SETTINGS, slow_id, [], mode="pool",
                              deadline_ms=now_ms(redis_client) + 60_000)
    assert not done and slow_id in pools(redis_client)
    assert {p["pool_id"]: p["state"] for p in State(redis_client, eager.settings)
            .worker_pools()}[slow_id] == "running"

    os.kill(fast.pid, signal.SIGSTOP)
    try:
        patient = Reaper(redis_client, Settings.load({}, environ={}))  # dead_after 30 s
        stopped_at = time.monotonic()
        result = wait_for(lambda: (r := patient.reap()).dead_pools and r, 10,
                          "the stopped pool to be reaped by its own dead_after")
        assert result.dead_pools == [fast_id]
        assert time.monotonic() - stopped_at < 1.5 + 1.5
    finally:
        os.kill(fast.pid, signal.SIGCONT)
    assert slow_id in pools(redis_client)
    assert "declared dead" not in slow.log_text()


def test_manual_reap_after_a_redis_outage_spares_live_pools_unless_forced(
        worker_factory: Any, tmp_path: Any) -> None:
    """Right after Redis was away for longer than dead_after every heartbeat is old.
    ``Client.reap()`` (``celery ext reap``) first watches Redis answer steadily for two
    heartbeat intervals and a second, in which the live pool stamps again: nothing is
    reaped. ``force=True`` does not watch and declares the live pool dead. (install(app)
    only: this is the client's and the worker pool's, alike in both modes.)"""
    from celery_ext.client import Client as ExtClient
    from celery_ext.testing.server import RedisServer

    env = {"CELERY_EXT_HEARTBEAT_INTERVAL": "1.5", "CELERY_EXT_DEAD_AFTER": "3.5",
           "CELERY_EXT_REAP_INTERVAL": "0.5"}
    with RedisServer(data_dir=tmp_path / "outage") as server:
        url = server.url(scheme="celery-ext")
        proj.configure(url)
        w = worker_factory(APP, broker_url=url, env=env, hostname="a@%h", pool="threads",
                           concurrency=2).start()
        client = server.client()
        (pool_id,) = wait_for(lambda: list(pools(client)), 10, "pool registration")

        def outage() -> redis.Redis:
            client.close()
            server.kill()  # AOF (fsync always) keeps the registration
            time.sleep(3.5 + 1)
            server.start()
            return server.client()

        client = outage()
        # The manual process's own settings (dead_after 1.5 s) do not matter either.
        result = ExtClient(client, SETTINGS).reap()
        assert result.dead_pools == [] and result.requeued == []
        assert result.watched >= 2 * 1.5 + 1 - 0.2, result
        assert pool_id in pools(client)
        assert "declared dead" not in w.log_text()

        client = outage()
        forced = ExtClient(client, SETTINGS).reap(force=True)
        assert forced.dead_pools == [pool_id] and forced.watched == 0
        w.wait_for_log("declared dead", timeout=10)  # it learns at its next heartbeat
        wait_for(lambda: list(pools(client)) == [pool_id], 10, "the pool registered again")
        w.stop()
