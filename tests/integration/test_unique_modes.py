"""Unique modes against real servers and ``celery worker`` subprocesses (issue 35):
``unique="until_finished"`` (held through the run and retries, released by the job's
final move, following a job whose pool was SIGKILLed) and ``debounce`` (a burst of
enqueues runs once, with the latest arguments), on one node and on a cluster.

Unique jobs need ``install(app)`` (its ``send_task`` computes the key); a drop-in
producer publishes them as plain jobs (docs/sets.md).
"""

from __future__ import annotations

import importlib
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

import celery_ext
import celery_ext.client
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup
from tests.apps import proj
from tests.helpers import Factory, recorded, start_workers, wait_for
from tests.integration.test_cluster_workers import records as records  # the fixture
from tests.integration.test_unique_limits import FAST_REAPER
from tests.webutil import run_cli
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
APP = "tests.apps.proj_unique"


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_unique

    return proj_unique


def locks(client: Any, keys: Keys = K) -> list[bytes]:
    """The unique locks there are now (a test's own server or namespace)."""
    return list(client.scan_iter(match=keys.unique("*"), count=1000))


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_until_finished_runs_once_while_it_runs(
        app: Any, pool: str, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    """Five enqueues while the job runs, on a pool with room for them, enqueue nothing:
    one run. Its ack releases the lock: the next enqueue runs again."""
    start_workers(worker_factory, 1, app=APP, pool=pool, concurrency=4)
    first = app.held.delay("k", 2.0)
    wait_for(lambda: recorded(rec, "start", "k"), 20, "the job to start")
    again = [app.held.delay("k", 2.0).id for _ in range(5)]
    assert again == [first.id] * 5
    assert locks(redis_client)  # held while it runs
    wait_for(lambda: recorded(rec, "runs", "k"), 20, "the job to finish")
    wait_for(lambda: not locks(redis_client), 5, "the lock released by the ack")
    time.sleep(1.0)  # (anything enqueued meanwhile would have started by now)
    assert len(recorded(rec, "start", "k")) == 1
    second = app.held.delay("k", 0.0)
    assert second.id != first.id
    wait_for(lambda: len(recorded(rec, "runs", "k")) == 2, 20, "the next run")
    wait_for(lambda: not locks(redis_client), 5, "the second lock released")


def test_until_finished_on_a_drop_in_worker_with_acks_late(
        app: Any, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory) -> None:
    """A drop-in worker (no ``install(app)``, Celery's own ``task_acks_late``) running an
    ``install(app)`` producer's jobs: the transport's ack releases the lock, so the job
    is locked until it finishes there too."""
    start_workers(worker_factory, 1, app=APP, pool="prefork", concurrency=4,
                  queues=[app.held.name],
                  env={"CELERY_EXT_NO_INSTALL": "1", "TEST_ACKS_LATE": "1"})
    first = app.held.delay("w", 2.0)
    wait_for(lambda: recorded(rec, "start", "w"), 20, "the job to start")
    assert [app.held.delay("w", 2.0).id for _ in range(5)] == [first.id] * 5
    wait_for(lambda: recorded(rec, "runs", "w"), 20, "the job to finish")
    wait_for(lambda: not locks(redis_client), 5, "the lock released by the ack")
    assert app.held.delay("w", 0.0).id != first.id
    wait_for(lambda: len(recorded(rec, "runs", "w")) == 2, 20, "the next run")
    assert len(recorded(rec, "start", "w")) == 2


def test_until_finished_keeps_its_lock_through_a_retry(
        app: Any, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory) -> None:
    """A failed run retried through the retry set keeps the lock (the retry takes it
    over before the old message is acked), while it waits and while it runs; the
    retry's success releases it."""
    start_workers(worker_factory, 1, app=APP, pool="threads", concurrency=4)
    first = app.held_retry.delay("r")
    wait_for(lambda: recorded(rec, "runs", "r") == ["0"], 20, "the first run")
    wait_for(lambda: redis_client.zcard(K.retry) == 1, 10, "the retry scheduled")
    time.sleep(0.3)  # the old message's ack is written after the retry's publish
    assert locks(redis_client)
    assert app.held_retry.delay("r").id == first.id  # still held: nothing enqueued
    wait_for(lambda: recorded(rec, "runs", "r") == ["0", "1"], 20, "the retry's run")
    assert app.held_retry.delay("r").id == first.id  # the retry runs: still held
    wait_for(lambda: recorded(rec, "done", "r"), 20, "the retry to finish")
    wait_for(lambda: not locks(redis_client), 5, "the lock released after the retry")
    time.sleep(1.0)
    assert recorded(rec, "runs", "r") == ["0", "1"]


def test_until_finished_dead_job_releases_its_lock(
        app: Any, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory) -> None:
    """A job that fails for good holds its lock while it runs, goes to the dead set, and
    its lock is released in the same script."""
    start_workers(worker_factory, 1, app=APP, pool="threads", concurrency=2)
    first = app.held_fails.delay("f")
    wait_for(lambda: recorded(rec, "runs", "f"), 20, "the job to start")
    assert app.held_fails.delay("f").id == first.id
    wait_for(lambda: redis_client.zcard(K.dead) == 1, 20, "the job in the dead set")
    assert not locks(redis_client)
    app.held_fails.delay("f")
    wait_for(lambda: redis_client.zcard(K.dead) == 2, 20, "the second job dead")
    assert recorded(rec, "runs", "f") == ["x", "x"]


def test_until_finished_job_of_a_killed_pool_runs_again_once(
        app: Any, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory) -> None:
    """SIGKILL of the pool mid-job: the lock follows the job back to its queue (an
    enqueue meanwhile adds nothing), the job runs again once elsewhere, and its ack
    there releases the lock."""
    victim = worker_factory(APP, pool="prefork", concurrency=2, env=FAST_REAPER).start()
    first = app.held.delay("s", 3.0)
    wait_for(lambda: recorded(rec, "start", "s"), 20, "the job to start")
    victim.stop(signal.SIGKILL)
    assert app.held.delay("s", 3.0).id == first.id
    worker_factory(APP, pool="prefork", concurrency=2, env=FAST_REAPER).start()
    wait_for(lambda: len(recorded(rec, "start", "s")) == 2, 30, "the job to run again")
    assert app.held.delay("s", 3.0).id == first.id  # running again: still held
    wait_for(lambda: recorded(rec, "runs", "s"), 20, "the job to finish")
    wait_for(lambda: not locks(redis_client), 5, "the lock released")
    time.sleep(1.0)
    assert len(recorded(rec, "start", "s")) == 2 and len(recorded(rec, "runs", "s")) == 1
    assert recorded(rec, "runs", "s")[0].split(":")[0] != str(victim.pid)


def test_until_finished_poison_pill_releases_its_lock(
        app: Any, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory) -> None:
    """A job whose pool died once too often goes to the dead set from the reaper's
    recovery, which releases its lock in the same script."""
    env = {**FAST_REAPER, "CELERY_EXT_MAX_RECOVERIES": "0"}
    victim = worker_factory(APP, pool="threads", concurrency=2, env=env).start()
    app.held.delay("p", 5.0)
    wait_for(lambda: recorded(rec, "start", "p"), 20, "the job to start")
    assert locks(redis_client)
    victim.stop(signal.SIGKILL)
    worker_factory(APP, pool="threads", concurrency=2, env=env).start()
    wait_for(lambda: redis_client.zcard(K.dead) == 1, 30, "the job in the dead set")
    assert not locks(redis_client)
    assert app.held.delay("p", 0.0)  # a new job, run at once
    wait_for(lambda: recorded(rec, "runs", "p"), 20, "the new job to run")


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_debounce_burst_runs_once_with_the_latest_arguments(
        app: Any, pool: str, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    """1,000 enqueues in a burst with one unique key: one job waits in the scheduled
    set, replaced by each enqueue; it runs once, 2 s after the last, with its ``n``."""
    start_workers(worker_factory, 1, app=APP, pool=pool, concurrency=4)
    ids = [app.debounced.delay("d", n).id for n in range(1000)]
    assert len(set(ids)) == 1000  # each enqueue is the new pending job
    assert redis_client.zcard(K.scheduled) == 1
    wait_for(lambda: recorded(rec, "runs", "d"), 20, "the debounced run")
    time.sleep(1.0)
    assert recorded(rec, "runs", "d") == ["999"]
    assert not locks(redis_client)  # released when it started (until_started)
    # A later enqueue is a new job, debounced in its turn.
    app.debounced.delay("d", 1000)
    wait_for(lambda: len(recorded(rec, "runs", "d")) == 2, 20, "the next debounced run")
    assert recorded(rec, "runs", "d") == ["999", "1000"]


def test_debounce_with_until_finished_holds_through_the_run(
        app: Any, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory) -> None:
    """Debounced and locked until finished: the burst runs once with its latest
    arguments, an enqueue while that run goes on is a no-op, and its ack frees the key."""
    start_workers(worker_factory, 1, app=APP, pool="threads", concurrency=4)
    ids = [app.debounced_held.delay("b", n).id for n in range(50)]
    wait_for(lambda: recorded(rec, "start", "b"), 20, "the debounced run to start")
    assert recorded(rec, "start", "b") == [f"49:{ids[-1]}"]
    assert app.debounced_held.delay("b", 50).id == ids[-1]  # running: held
    wait_for(lambda: recorded(rec, "runs", "b"), 20, "the run to finish")
    wait_for(lambda: not locks(redis_client), 5, "the lock released by the ack")
    time.sleep(1.5)  # (a job replaced or enqueued meanwhile would have started by now)
    assert recorded(rec, "runs", "b") == ["49"]


# -- a cluster ------------------------------------------------------------------------

CLUSTER_APP = "tests.apps.proj_cluster"


def _declared(i: int, sleep: float = 0.0, hold: str = "") -> None:
    """The producer's declaration of a task the worker runs (never run here)."""


def test_unique_modes_on_a_cluster(
        cluster: ClusterGroup, records: tuple[str, redis.Redis],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """On a cluster the lock lives in its job queue's copy: until_finished holds while
    the job runs and its ack there releases it; a debounced burst runs once."""
    record_url, rec = records
    namespace = "cl" + uuid.uuid4().hex[:8]
    url = cluster.url()
    env = {"CELERY_EXT_NAMESPACE": namespace, "CELERY_EXT_RECORD_URL": record_url}
    worker_factory(CLUSTER_APP, broker_url=url, pool="threads", concurrency=4,
                   env=env).start(timeout=60)
    # The worker's app in this process too, as a full run may have imported it before
    # (test_revoke.py): its plain job5 and job6 are shared tasks (Celery's default), given
    # to every app finalized later, this producer's included.
    importlib.import_module(CLUSTER_APP)
    app = Celery("producer", broker=url)
    app.conf.broker_transport_options = {"cluster": True, "namespace": namespace}
    app.conf.task_ignore_result = True
    celery_ext.install(app)
    # The producer's declarations are registered at once (lazy=False), before the app is
    # finalized and given the shared tasks: an app keeps the first declaration of a name,
    # and shared ones come in the order of a set. Lazy and shared (as they were), they lost
    # at times to proj_cluster's, and the burst went out as 100 plain jobs that all ran
    # (issue 35). Not shared: later tests' apps keep proj_cluster's plain job5 and job6.
    held = app.task(name=f"{CLUSTER_APP}.job5", shared=False, lazy=False,
                    unique="until_finished",
                    unique_key=lambda i, sleep=0.0, hold="": "k")(_declared)
    debounced = app.task(name=f"{CLUSTER_APP}.job6", shared=False, lazy=False, unique=True,
                         debounce=2.0, unique_key=lambda i, sleep=0.0, hold="": "k")(_declared)
    assert (app.tasks[held.name].unique, app.tasks[debounced.name].debounce) \
        == ("until_finished", 2.0)
    keys = Keys(namespace, cluster=True)
    rc = celery_ext.client.Client.for_app(app).client
    try:
        rec.set("hold", 1)
        first = held.delay(0, hold="hold")
        copy = keys.of(held.name)
        wait_for(lambda: rc.llen(copy.queue_level(held.name, 0)) == 0, 20, "the job fetched")
        assert [held.delay(i, hold="hold").id for i in range(1, 6)] == [first.id] * 5
        rec.delete("hold")
        wait_for(lambda: rec.get("runs:job5:0"), 20, "the held job to finish")
        wait_for(lambda: not locks(rc, copy), 5, "the lock released in its copy")
        held.delay(6)
        wait_for(lambda: rec.get("runs:job5:6"), 20, "the next run")
        assert [int(rec.get(f"runs:job5:{i}") or 0) for i in range(7)] == [1, 0, 0, 0, 0, 0, 1]

        for i in range(100):
            debounced.delay(i)
        wait_for(lambda: rec.get("runs:job6:99"), 20, "the debounced run")
        time.sleep(1.0)
        assert [int(v or 0) for v in rec.mget([f"runs:job6:{i}" for i in range(100)])] \
            == [0] * 99 + [1]
    finally:
        rc.close()


def test_a_jobs_status_shows_its_unique_lock(
        app: Any, broker_url: str, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    """``Client.job`` (the CLI's ``ext job``, the API's ``/api/jobs/<id>``) shows a unique
    job's lock while its message is in a record: scheduled, then in flight while it
    runs (held by this job, with the TTL left), and none once it finished."""
    client = celery_ext.client.Client.for_app(app.app)
    later = app.held.apply_async(("shown", 1.5), countdown=1.0)
    lock = client.job(later.id)["unique_lock"]
    assert lock is not None and lock["held"] and lock["holder"] == later.id, lock
    assert lock["mode"] == "until_finished"
    assert lock["ttl"] is not None and lock["ttl"] > 0
    shown = run_cli(broker_url, "job", later.id)
    (line,) = [ln for ln in shown.stdout.splitlines() if ln.startswith("unique_lock ")]
    assert "until_finished, held by this job" in line, line
    assert " s left (tests.apps.proj_unique.held:" in line, line
    start_workers(worker_factory, 1, app=APP, pool="threads", concurrency=2)
    wait_for(lambda: recorded(rec, "start", "shown"), 20, "the job to start")
    status = client.job(later.id)
    assert status["state"] in ("running", "reserved"), status
    assert status["unique_lock"] is not None and status["unique_lock"]["held"], status
    wait_for(lambda: recorded(rec, "runs", "shown"), 20, "the job to finish")
    # Its result is stored before its ack (acks_late), which releases the lock.
    wait_for(lambda: client.job(later.id)["unique_lock"] is None, 10, "the lock gone")
    assert client.job(later.id)["done"] and not locks(redis_client)
    assert client.job(str(uuid.uuid4()))["unique_lock"] is None
