"""The gevent executor (``-P gevent``): jobs are greenlets of the worker's main process,
sharing its Redis clients with the consumer, and Celery's signal handlers run in
gevent's event loop.

Real server, real ``celery worker -P gevent`` subprocesses (tests/apps/proj_pools.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ext.config import Settings
from celery_ext.store.keys import Keys
from tests.apps import proj
from tests.helpers import wait_for
from tests.workers import REPO_ROOT, WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

FAST = {
    "CELERY_EXT_HEARTBEAT_INTERVAL": "0.25",
    "CELERY_EXT_DEAD_AFTER": "1.5",
    "CELERY_EXT_REAP_INTERVAL": "0.5",
}
KEYS = Keys(Settings.load({}, environ=FAST).namespace)
APP = "tests.apps.proj_pools"


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_pools

    return proj_pools


def start_worker(factory: Any, **kw: Any) -> WorkerProcess:
    env = {**FAST, **kw.pop("env", {})}
    return factory(APP, pool="gevent", env=env, **kw).start()


def test_jobs_failing_together_all_reach_the_dead_set(app: Any, worker_factory: Any,
                                                      redis_client: redis.Redis) -> None:
    """200 greenlets fail in the same instant, each moving its job to the dead set from
    the main process: our clients must serve that many greenlets at once (Kombu sizes a
    channel's connections for 10), or a failed job is acked without its dead record."""
    w = start_worker(worker_factory, concurrency=200)
    n = 600
    for i in range(n):
        app.fail_after.delay(f"f{i}", 0.05)
    def settled() -> bool:
        return redis_client.zcard(KEYS.dead) >= n or "could not move" in w.log_tail(2000)

    wait_for(settled, 30, f"the {n} failed jobs in the dead set")
    assert "could not move" not in w.log_tail(2000)
    assert redis_client.zcard(KEYS.dead) == n


def test_warm_shutdown_says_stopping_without_a_signal_handler_error(
        app: Any, worker_factory: Any, redis_client: redis.Redis) -> None:
    """Celery's SIGTERM handler runs in gevent's event loop, where nothing may block: the
    pool still says "stopping" (a checking-in job is told to stop) and the handler
    raises nothing."""
    w = start_worker(worker_factory, concurrency=4)
    rec = proj.recorder()
    app.long_checkin.delay("lc", 20.0)
    wait_for(lambda: rec.llen("start:lc") or None, 10, "the job started")
    w.stop()
    assert rec.lrange("stopped:lc", 0, -1), "the job was not told to stop"
    assert "raised" not in w.log_tail(400)
    assert w.returncode == 0


def test_sigkill_gevent_worker_its_jobs_rerun_elsewhere_once(
        app: Any, worker_factory: Any, redis_client: redis.Redis, rec: redis.Redis) -> None:
    """A gevent worker running jobs as greenlets is SIGKILLed: the jobs it held (fetched
    into its in-flight record, running or reserved) run again on another worker, each
    once more at most, within dead_after + the reap interval + 1 s."""
    settings = Settings.load({}, environ=FAST)
    victim = start_worker(worker_factory, concurrency=4, hostname="a@%h")
    keys = [f"k{i}" for i in range(8)]
    for k in keys:
        app.slow.delay(k, 3.0)
    wait_for(lambda: any(starts(rec, k) for k in keys), 10, "the victim running a job")
    survivor = worker_factory(APP, pool="threads", concurrency=8, hostname="b@%h",
                              env=FAST).start()
    kill_at = time.time()
    victim.kill()
    wait_for(lambda: all(rec.lrange(f"runs:{k}", 0, -1) for k in keys), 30,
             "every job to complete")
    reruns = [float(s.split(":")[1]) for k in keys for s in starts(rec, k)
              if float(s.split(":")[1]) > kill_at]
    assert reruns, "the victim's jobs were not run again"
    limit = settings.dead_after + settings.reap_interval * 1.2 + 1.0
    assert min(reruns) - kill_at < limit, (min(reruns) - kill_at, limit)
    for k in keys:
        assert len(starts(rec, k)) <= 2
    wait_for(lambda: all(int(v) == 0 for v in redis_client.hgetall(KEYS.running).values()),
             10, "running counts back to 0")
    survivor.stop()


def test_a_full_prefetch_fetches_again_as_soon_as_a_job_ends(
        app: Any, worker_factory: Any, rec: redis.Redis) -> None:
    """One greenlet, prefetch 1: the pool's prefetch is full while a job runs, and its
    ack makes room for the next fetch. With no event loop under gevent, the ack wakes
    the poll (``wakeup.WakePipe``): 10 jobs of a few ms run within 3 s (a solo pool
    takes a fraction of a second), not one per Celery's 2 s poll timeout."""
    start_worker(worker_factory, concurrency=1, extra_args=["--prefetch-multiplier", "1"])
    for i in range(10):
        app.slow.delay(f"p{i}", 0.0)
    wait_for(lambda: all(rec.llen(f"runs:p{i}") for i in range(10)), 3,
             "the 10 jobs, fetched one after another")


def starts(rec: redis.Redis, key: str) -> list[str]:
    return [v.decode() for v in rec.lrange(f"start:{key}", 0, -1)]


def test_eventlet_is_refused_with_one_line_naming_gevent(tmp_path: Path,
                                                         broker_url: str) -> None:
    """``celery worker -P eventlet`` stops at start with one line naming gevent. (Celery
    imports eventlet to monkey-patch before anything of ours runs; a stand-in module lets
    the command reach the start-up check where eventlet is not installed.)"""
    stand_in = tmp_path / "stand_in" / "eventlet"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("def monkey_patch():\n    pass\n")
    (stand_in / "debug.py").write_text("")
    env = {**os.environ, "CELERY_EXT_BROKER_URL": broker_url,
           "PYTHONPATH": os.pathsep.join((str(REPO_ROOT), str(stand_in.parent)))}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "worker", "-P", "eventlet", "-c", "2"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == ("celery_ext: the eventlet pool is not supported; use gevent for "
                         "green threads (-P gevent), or prefork, threads or solo"), done.stderr
    assert "Traceback" not in done.stderr


def test_an_idle_gevent_worker_stops_without_waiting_out_celerys_poll(
        app: Any, worker_factory: Any, redis_client: redis.Redis) -> None:
    """Without an event loop Celery reads its shutdown flag when ``drain_events(timeout=
    2.0)`` returns, and once more after it (1.6-2.5 s measured for an idle pool before):
    a stopping worker ends our polls (``MultiChannelPoller.stop_soon``), so it exits in
    well under Celery's 2 s poll (0.5 s measured), deregistered."""
    w = start_worker(worker_factory, concurrency=20)
    wait_for(lambda: redis_client.zcard(KEYS.pools) or None, 10, "the pool registered")
    time.sleep(0.5)  # idle: the consumer waits in its poll
    t0 = time.monotonic()
    assert w.stop() == 0
    took = time.monotonic() - t0
    assert took < 1.5, f"stopped after {took:.2f}s"
    assert redis_client.zcard(KEYS.pools) == 0
