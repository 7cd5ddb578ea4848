"""Scheduled and retry sets (issue 4): countdown/eta jobs live in Redis, not in workers.

Real server, real ``celery worker`` subprocesses running ``tests.apps.proj_sets``. Tests
taking the ``mode`` fixture run twice: with ``install(app)`` and drop-in (only the
broker URL changed; a stock Celery app sends to the ``celery`` queue).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ext.client import Client
from celery_ext.config import Settings
from celery_ext.producer.scheduled import schedule
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.testing.server import RedisServer
from celery_ext.worker.requeuer import Requeuer
from tests.apps import proj
from tests.helpers import Factory, Mode, message, start_workers, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
APP = "tests.apps.proj_sets"


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_sets

    return proj_sets


def timed_runs(rec: redis.Redis, key: str) -> list[tuple[str, float, float]]:
    """(task id, started at, eta) per run of ``timed``."""
    out = []
    for raw in rec.lrange(f"runs:{key}", 0, -1):
        task_id, start, eta = raw.decode().split(" ", 2)
        out.append((task_id, float(start), datetime.fromisoformat(eta).timestamp()))
    return out


# -- promotion, in-process ---------------------------------------------------------------------


def test_promote_moves_each_due_job_exactly_once_across_racing_requeuers(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """Eight requeuers promote 2,000 due jobs at once: each lands in its queue once,
    plain jobs at the back and retries at the front, and nothing not yet due moves."""
    settings = Settings(promote_batch=50)
    scripts = Scripts(redis_client)
    for i in range(2000):
        q = f"q{i % 5}"
        schedule(scripts, K, q, message(f"t{i}", q, retries=i % 2), 1, redis_client)
    schedule(scripts, K, "q0", message("later", "q0"), 60_000, redis_client)
    redis_client.lpush(K.queue("q0"), json.dumps(message("old", "q0")))  # already queued
    time.sleep(0.01)
    requeuers = [Requeuer(redis_server.client(), settings) for _ in range(8)]
    barrier = threading.Barrier(len(requeuers))
    moved: list[int] = []

    def run(r: Requeuer) -> None:
        barrier.wait()
        moved.append(r.promote().moved)

    threads = [threading.Thread(target=run, args=(r,)) for r in requeuers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(moved) == 2000
    tags: Counter[str] = Counter()
    for q in range(5):
        queued = [json.loads(m)["properties"]["delivery_tag"]
                  for m in redis_client.lrange(K.queue(f"q{q}"), 0, -1)]
        tags.update(queued)
        if q == 0:
            # Fetch pops the right end: retries (odd) were pushed there, plain jobs left
            # of the job that was already queued.
            old = queued.index("old")
            assert all(int(t[1:]) % 2 == 0 for t in queued[:old])
            assert all(int(t[1:]) % 2 == 1 for t in queued[old + 1:])
    assert len(tags) == 2001 and set(tags.values()) == {1}
    assert redis_client.zcard(K.scheduled) == 1 and redis_client.zcard(K.retry) == 0
    assert redis_client.hlen(K.scheduled_jobs) == 1
    assert redis_client.smembers(K.ready) == {f"q{i}".encode() for i in range(5)}
    next_due = Requeuer(redis_client, settings).promote().next_due_in
    assert next_due is not None and 55 < next_due <= 60


def test_requeuer_wakes_for_an_earlier_job_and_sleeps_when_idle(
        redis_client: redis.Redis) -> None:
    """An idle requeuer sends about one command per promote_interval; a job scheduled
    earlier than everything wakes it through pub/sub, so it is promoted on time."""
    requeuer = Requeuer(redis_client, Settings(promote_interval=3.0))
    requeuer.start()
    try:
        time.sleep(0.3)
        passes = requeuer.passes
        time.sleep(1.0)
        assert requeuer.passes == passes  # asleep: no polling
        schedule(Scripts(redis_client), K, "q", message("t1", "q"), 300, redis_client)
        t0 = time.monotonic()
        wait_for(lambda: redis_client.llen(K.queue("q")), 2, "promotion", step=0.01)
        assert 0.28 < time.monotonic() - t0 < 0.5
    finally:
        requeuer.stop()


def test_one_requeuer_leads_and_hands_over_when_it_stops(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """Only the lease holder wakes for every due time; the others take over at once
    when it stops cleanly (and after the lease expires when it dies)."""
    settings = Settings(promote_interval=2.0)
    first = Requeuer(redis_server.client(), settings)
    second = Requeuer(redis_server.client(), settings)
    first.start()
    try:
        wait_for(lambda: first.leader, 2, "the first requeuer to lead")
        second.start()
        time.sleep(0.3)
        assert not second.leader
        first.stop()
        wait_for(lambda: second.leader, 1, "the second requeuer to take over")
        schedule(Scripts(redis_client), K, "q", message("t1", "q"), 200, redis_client)
        wait_for(lambda: redis_client.llen(K.queue("q")), 1, "promotion by the new leader")
    finally:
        first.stop()
        second.stop()


# -- end to end ----------------------------------------------------------------------------------


def test_thousand_countdowns_run_once_none_early(
        app: Any, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory) -> None:
    """1,000 jobs with random countdowns of 0-3 s over three pools: each runs exactly
    once and none before its eta. The lateness is printed, not asserted: it measures
    the CPU the host gives the pools (speed belongs in bench/), while exactly-once and
    none-early hold however loaded the machine is.

    The countdowns start 4 s after the first enqueue so that, on a quiet machine, all
    jobs are stored before the first is due. (install(app) only: promotion is the
    pool's requeuer in both modes, checked drop-in by the visibility-timeout and
    expiry tests below and tests/integration/test_configurations.py.)"""
    start_workers(worker_factory, 3, concurrency=2)
    # Warm up (each prefork child connects and imports on its first job).
    for _ in range(60):
        app.timed.delay("warm")
    wait_for(lambda: rec.llen("runs:warm") >= 60, 10, "the warm-up jobs")
    rng = random.Random(4)
    base = time.time() + 4
    with proj.app.producer_or_acquire() as producer:
        sent = [app.timed.apply_async(("k",), producer=producer,
                                      countdown=base - time.time() + rng.uniform(0, 3)).id
                for _ in range(1000)]
    wait_for(lambda: rec.llen("runs:k") >= 1000, 60, "1,000 runs")
    time.sleep(0.5)  # a duplicate would show up now
    runs = timed_runs(rec, "k")
    assert Counter(r[0] for r in runs) == Counter(sent)
    lateness = sorted(start - eta for _, start, eta in runs)
    assert lateness[0] > -0.002, f"a job ran {-lateness[0]:.3f}s early"
    print(f"\npromotion lateness over 1,000 countdown jobs, 3 pools x 2: "
          f"p50 {statistics.median(lateness) * 1000:.1f} ms, "
          f"p99 {lateness[int(len(lateness) * 0.99) - 1] * 1000:.1f} ms, "
          f"max {lateness[-1] * 1000:.1f} ms (load average {os.getloadavg()[0]:.1f})")
    assert redis_client.zcard(K.scheduled) == 0 and redis_client.hlen(K.scheduled_jobs) == 0


@pytest.mark.parametrize(("mode", "pool"), [("install", "prefork"), ("dropin", "prefork"),
                                            ("dropin", "gevent")], indirect=["mode"])
def test_countdown_longer_than_visibility_timeout_runs_once(
        app: Any, mode: Mode, pool: str, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    """Stock Celery redelivers an ETA job after visibility_timeout; here it is not in
    flight until due, and in-flight jobs have no timeout at all."""
    start_workers(worker_factory, 2, pool=pool, env=mode.env(TEST_VISIBILITY_TIMEOUT="1"))
    job = mode.send(app.timed, "vt", countdown=3)
    # It waits in Redis, not in a worker's memory (stock Celery: inspect().scheduled()),
    # and each worker's `inspect scheduled` answers from Redis: both list the one job.
    assert Client(redis_client).counts()["scheduled"] == 1
    held = mode.app.control.inspect(timeout=5, limit=2).scheduled() or {}
    assert len(held) == 2, held
    assert all([j["request"]["id"] for j in jobs] == [job.id] for jobs in held.values()), held
    wait_for(lambda: rec.llen("runs:vt"), 10, "the countdown job")
    time.sleep(2.5)
    assert rec.llen("runs:vt") == 1


def test_scheduled_jobs_survive_a_redis_restart(tmp_path: Path, worker_factory: Factory) -> None:
    """Redis is killed (AOF, appendfsync always) and restarted while jobs wait in the
    scheduled set: the worker reconnects and every job runs once. (install(app) only:
    what is tested is the server's AOF and the pool's reconnect, alike in both modes.)"""
    with RedisServer(data_dir=tmp_path / "data") as server:
        url = server.url(scheme="celery-ext")
        proj.configure(url)
        from tests.apps import proj_sets

        worker = worker_factory(APP, broker_url=url, env={"CELERY_EXT_PROMOTE_INTERVAL": "1"})
        worker.start()
        sent = [proj_sets.timed.apply_async(("rs",), countdown=1.5 + i * 0.05).id
                for i in range(20)]
        client = server.client()
        assert client.zcard(K.scheduled) == 20
        client.close()
        server.restart(hard=True)
        rec = server.client(db=2)
        wait_for(lambda: rec.llen("runs:rs") >= 20, 30, "20 runs after the restart")
        time.sleep(0.5)
        assert sorted(r[0] for r in timed_runs(rec, "rs")) == sorted(sent)
        rec.close()
        worker.stop()


def test_expired_job_is_not_run_and_lands_in_the_dead_set(
        app: Any, mode: Mode, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    start_workers(worker_factory, 1, env=mode.env())
    # A job in a job queue is due by the Redis clock, whatever its eta header says (a
    # worker whose clock runs behind must not hold it): run a 60 s countdown now.
    early = mode.send(app.timed, "now", countdown=60)
    (job,) = Client(redis_client).scheduled()["items"]
    assert job["task_id"] == early.id and Client(redis_client).run_scheduled_now(job["id"])
    wait_for(lambda: rec.llen("runs:now"), 3, "the job made due by hand")

    late = mode.send(app.timed, "ex", countdown=1, expires=0.5)
    ok = mode.send(app.timed, "ok", countdown=0.5, expires=30)
    client = Client(redis_client)
    dead = wait_for(lambda: client.dead()["items"], 10, "the expired job in the dead set")
    assert rec.llen("runs:ex") == 0
    wait_for(lambda: rec.llen("runs:ok"), 5, "the job that had not expired")
    (job,) = dead
    assert job["reason"] == "expired" and job["task_id"] == late.id
    assert job["name"] == "tests.apps.proj_sets.timed" and "expired at" in job["error"]
    assert ok.id != late.id
