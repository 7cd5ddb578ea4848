"""Resumable jobs (issue 35): a long job killed with its pool, or returned at a warm
shutdown, resumes from its cursor instead of starting over.

Real ``celery worker`` subprocesses run ``tests/apps/resumable.py``'s job, which appends
each step it does to a file and checks in with the step as its cursor. Each pool is
SIGKILLed whole (main process and children, as a lost host) three times mid-job; a
new pool's reaper returns the job to its queue and the next run reads ``self.cursor``.
At the end every step was done once, twice at most for a step in progress at a kill,
and the finished job left no cursor. Before resumable jobs every run started at step 1.
"""

from __future__ import annotations

import itertools
import os
import signal
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ext.store.connections import cluster_client, cluster_config
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup, RedisServer
from tests.apps import proj_resume
from tests.apps.resumable import read_steps
from tests.helpers import Factory, K, Mode, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes
from tests.workers import WorkerProcess

APP = "tests.apps.proj_resume"
CLUSTER_APP = "tests.apps.proj_resume_cluster"
#: Short liveness timings (a dead pool is found within ~2 s), and a cursor written at
#: every checkin, so a kill redoes at most the step in progress.
FAST = {
    "CELERY_EXT_HEARTBEAT_INTERVAL": "0.25",
    "CELERY_EXT_DEAD_AFTER": "1.5",
    "CELERY_EXT_REAP_INTERVAL": "0.5",
    "CELERY_EXT_CURSOR_INTERVAL": "0",
}
STEPS, PAUSE = 30, 0.15
KILLS = 3
#: Steps a run does before the test kills its pool.
STEPS_PER_RUN = 4
POOLS = ["prefork", "threads", "gevent"]


def kill_whole(worker: WorkerProcess) -> None:
    """SIGKILL the worker's whole process group (its prefork children too): nothing of
    it writes again, as when its host is lost."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    worker.stop(timeout=10)  # reaps it (nothing is left to signal)


def kill_three_times(path: Path, start: Callable[[], WorkerProcess]) -> None:
    """Kill the pool running the job ``KILLS`` times, each time after its run did
    ``STEPS_PER_RUN`` steps, starting a new pool (whose reaper recovers the job)."""
    worker = start()
    for kill in range(KILLS):
        def run_far_enough(kill: int = kill) -> bool:
            steps, starts, _ = read_steps(path)
            return len(starts) == kill + 1 and len(steps) >= (kill + 1) * STEPS_PER_RUN
        wait_for(run_far_enough, 60, f"run {kill + 1} doing {STEPS_PER_RUN} steps")
        kill_whole(worker)
        worker = start()


def check_steps(path: Path, runs: int, redone_at_most: int) -> None:
    steps, starts, done = read_steps(path)
    print(f"runs started at {starts}; steps done {steps}")
    assert done
    counts = Counter(steps)
    assert sorted(counts) == list(range(1, STEPS + 1))
    assert max(counts.values()) <= 2, counts
    assert sum(1 for n in counts.values() if n == 2) <= redone_at_most, counts
    assert len(starts) == runs
    # The first run starts at 0, and every later one where the one before it was.
    assert starts[0] == 0
    assert all(b > a for a, b in itertools.pairwise(starts)), starts


@pytest.mark.parametrize("pool", POOLS)
def test_a_resumable_job_killed_three_times_does_each_step_once(
        tmp_path: Path, worker_factory: Factory, mode: Mode, pool: str,
        redis_client: redis.Redis) -> None:
    path = tmp_path / "steps.txt"
    env = mode.env(acks_late=True, **FAST)
    job = mode.send(proj_resume.resumable, str(path), STEPS, PAUSE)
    kill_three_times(path, lambda: worker_factory(APP, pool=pool, env=env).start(timeout=60))
    assert job.get(timeout=90) == STEPS
    check_steps(path, runs=KILLS + 1, redone_at_most=KILLS)
    cursor = K.of(mode.queue(proj_resume.resumable)).cursor(job.id)
    wait_for(lambda: not redis_client.exists(cursor), 10, "the finished job's cursor to go")
    assert redis_client.zcard(K.dead) == 0


@pytest.mark.parametrize("pool", POOLS)
def test_a_resumable_job_returned_at_a_warm_shutdown_resumes_elsewhere(
        tmp_path: Path, worker_factory: Factory, mode: Mode, pool: str,
        redis_client: redis.Redis) -> None:
    """SIGTERM: the job's checkin answers "stop", it raises ``Interrupted`` and goes back
    to its queue with its last cursor (written at once, though the cursor interval is the
    default second), and a pool started later does the rest: each step exactly once."""
    path = tmp_path / "steps.txt"
    env = mode.env(acks_late=True)
    job = mode.send(proj_resume.resumable, str(path), STEPS, PAUSE)
    first = worker_factory(APP, pool=pool, env=env).start(timeout=60)
    wait_for(lambda: len(read_steps(path)[0]) >= 5, 60, "the first steps")
    assert first.stop(signal.SIGTERM, timeout=30) == 0
    assert not first.stop_timed_out
    steps, starts, done = read_steps(path)
    assert not done and len(starts) == 1
    worker_factory(APP, pool=pool, env=env).start(timeout=60)
    assert job.get(timeout=90) == STEPS
    check_steps(path, runs=2, redone_at_most=0)
    assert read_steps(path)[1][1] == len(steps)  # resumed where it stopped
    cursor = K.of(mode.queue(proj_resume.resumable)).cursor(job.id)
    wait_for(lambda: not redis_client.exists(cursor), 10, "the finished job's cursor to go")


# -- a cluster ------------------------------------------------------------------------------
@pytest.fixture
def cluster_records(redis_server: RedisServer) -> Iterator[str]:
    """Where the cluster app's jobs record (its one-node server; the steps go to a file)."""
    yield redis_server.url(db=3)


@pytest.mark.parametrize("mode", ["install", "dropin"])
def test_a_resumable_job_killed_three_times_on_a_cluster(
        tmp_path: Path, worker_factory: Factory, cluster: ClusterGroup,
        cluster_records: str, mode: str) -> None:
    namespace = "rs" + uuid.uuid4().hex[:8]
    url = cluster.url()
    env = {"CELERY_EXT_NAMESPACE": namespace, "CELERY_EXT_RECORD_URL": cluster_records,
           **FAST}
    if mode == "dropin":
        env.update(CELERY_EXT_NO_INSTALL="1")
    app = Celery("producer", broker=url)
    app.conf.broker_transport_options = {"cluster": True, "namespace": namespace}
    app.conf.task_ignore_result = True
    if mode == "install":
        import celery_ext
        celery_ext.install(app)
    name = f"{CLUSTER_APP}.resumable"
    path = tmp_path / "steps.txt"
    try:
        job = app.send_task(name, (str(path), STEPS, PAUSE))
        kill_three_times(path, lambda: worker_factory(
            CLUSTER_APP, broker_url=url, pool="threads", env=env).start(timeout=60))
        wait_for(lambda: read_steps(path)[2], 90, "the job to finish")
        check_steps(path, runs=KILLS + 1, redone_at_most=KILLS)
        queue = name if mode == "install" else "celery"
        cursor = Keys(namespace, cluster=True).of(queue).cursor(job.id)
        config = cluster_config([url], {"cluster": True})
        assert config is not None
        rc: Any = cluster_client(config, {"socket_timeout": 5.0})
        try:
            wait_for(lambda: not rc.exists(cursor), 10, "the finished job's cursor to go")
        finally:
            rc.close()
    finally:
        app.close()
