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
import json
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

from celery_ext.config import Settings
from celery_ext.store.connections import cluster_client, cluster_config
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.testing.server import ClusterGroup, RedisServer
from celery_ext.worker.inflight import InflightRecord, recover_tags
from tests.apps import proj_resume
from tests.apps.resumable import read_steps
from tests.helpers import Factory, K, Mode, message, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes
from tests.workers import WorkerProcess

#: No test reads what its pools would write at a warm stop (the warm-shutdown tests stop
#: theirs themselves): their teardown SIGKILLs them (tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

APP = "tests.apps.proj_resume"
CLUSTER_APP = "tests.apps.proj_resume_cluster"
#: Short liveness timings (a dead pool is found within ~2 s), and a cursor written at
#: every checkin, so a kill redoes at most the step in progress.
FAST = {
    "CELERY_EXT_HEARTBEAT_INTERVAL": "0.25",
    "CELERY_EXT_DEAD_AFTER": "1.5",
    "CELERY_EXT_REAP_INTERVAL": "0.25",
    "CELERY_EXT_CURSOR_INTERVAL": "0",
}
#: The job of the warm-shutdown tests: its steps outlast a pool's stop by seconds.
STEPS, PAUSE = 30, 0.15
KILLS = 3
#: Steps a run does before the test kills its pool.
STEPS_PER_RUN = 4
#: The job killed three times: its runs do KILLS * STEPS_PER_RUN steps (a few more if
#: one is redone), and the last run has some left.
KILLED_STEPS, KILLED_PAUSE = 20, 0.1
POOLS = ["prefork", "threads", "gevent"]


def kill_whole(worker: WorkerProcess) -> None:
    """SIGKILL the worker's whole process group (its prefork children too): nothing of
    it writes again, as when its host is lost."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    worker.stop(timeout=10)  # reaps it (nothing is left to signal)


def kill_three_times(path: Path, make: Callable[[], WorkerProcess]) -> None:
    """Kill the pool running the job ``KILLS`` times, each time after its run did
    ``STEPS_PER_RUN`` steps, with a new pool up (whose reaper recovers the job).

    The new pool starts once the run has started: the job is then in the running pool's
    in-flight record, so the new pool idles until a reaper finds that pool dead, and its
    start (a second or two) overlaps the run's steps and the wait for the reaper instead
    of adding to the test's time."""
    worker = make().start(timeout=60)
    for kill in range(KILLS):
        def run_started(kill: int = kill) -> bool:
            return len(read_steps(path)[1]) == kill + 1
        wait_for(run_started, 60, f"run {kill + 1} to start")
        spare = make().start(wait_ready=False)

        def run_far_enough(kill: int = kill) -> bool:
            steps, starts, _ = read_steps(path)
            return len(starts) == kill + 1 and len(steps) >= (kill + 1) * STEPS_PER_RUN
        wait_for(run_far_enough, 60, f"run {kill + 1} doing {STEPS_PER_RUN} steps")
        kill_whole(worker)
        assert spare.ready_pattern
        spare.wait_for_log(spare.ready_pattern, timeout=60)
        worker = spare


def check_steps(path: Path, total: int, runs: int, redone_at_most: int) -> None:
    steps, starts, done = read_steps(path)
    print(f"runs started at {starts}; steps done {steps}")
    assert done
    counts = Counter(steps)
    assert sorted(counts) == list(range(1, total + 1))
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
    job = mode.send(proj_resume.resumable, str(path), KILLED_STEPS, KILLED_PAUSE)
    kill_three_times(path, lambda: worker_factory(APP, pool=pool, env=env))
    assert job.get(timeout=90) == KILLED_STEPS
    check_steps(path, KILLED_STEPS, runs=KILLS + 1, redone_at_most=KILLS)
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
    check_steps(path, STEPS, runs=2, redone_at_most=0)
    assert read_steps(path)[1][1] == len(steps)  # resumed where it stopped
    cursor = K.of(mode.queue(proj_resume.resumable)).cursor(job.id)
    wait_for(lambda: not redis_client.exists(cursor), 10, "the finished job's cursor to go")


def test_a_retried_job_resumes_from_its_cursor_and_leaves_none(
        tmp_path: Path, worker_factory: Factory, mode: Mode, redis_client: redis.Redis) -> None:
    """A retry is the same job not finished: its run reads the cursor the retrying run
    kept (written at the run's end, within the cursor interval), then finishes and
    leaves no cursor: through the ack (install: acked when it ends), or at its end in
    drop-in mode with Celery's default (acked when it starts: no ack comes later)."""
    path = tmp_path / "steps.txt"
    worker_factory(APP, pool="prefork", env=mode.env(acks_late=not mode.dropin)).start(
        timeout=60)
    job = mode.send(proj_resume.retried, str(path), 10, 6)
    assert job.get(timeout=60) == 10
    steps, starts, done = read_steps(path)
    assert done and starts == [0, 6] and steps == list(range(1, 11))
    cursor = K.of(mode.queue(proj_resume.retried)).cursor(job.id)
    wait_for(lambda: not redis_client.exists(cursor), 10, "the finished job's cursor to go")


def test_a_cursor_over_the_limit_is_refused_with_one_line_and_the_job_runs_on(
        worker_factory: Factory, mode: Mode, redis_client: redis.Redis) -> None:
    worker = worker_factory(APP, pool="threads", env=mode.env(
        acks_late=True, CELERY_EXT_CURSOR_MAX_BYTES="100")).start(timeout=60)
    job = mode.send(proj_resume.big_cursor, 200)
    assert job.get(timeout=30) is None  # never kept
    refused = [line for line in worker.log_text().splitlines() if "cursor_max_bytes" in line]
    assert len(refused) == 1, refused
    assert "is 202 bytes as JSON, over cursor_max_bytes (100)" in refused[0]
    assert not redis_client.keys(K.cursor("*"))


def test_a_dead_job_keeps_no_cursor(
        worker_factory: Factory, mode: Mode, redis_client: redis.Redis) -> None:
    worker_factory(APP, pool="threads", env=mode.env(acks_late=True)).start(timeout=60)
    job = mode.send(proj_resume.fails_with_cursor)
    wait_for(lambda: redis_client.zcard(K.dead) == 1, 30, "the job in the dead set")
    assert job.state == "FAILURE"
    (record,) = redis_client.hvals(K.dead_jobs)
    assert b"ValueError: this job fails" in record  # (its checkin with a cursor worked)
    assert not redis_client.exists(K.of(mode.queue(proj_resume.fails_with_cursor))
                                   .cursor(job.id))


def test_interrupted_in_a_job_acked_when_it_started_says_it_in_one_line(
        worker_factory: Factory, broker_url: str, redis_client: redis.Redis) -> None:
    """Drop-in with Celery's default ack (at the start): the job cannot go back to its
    queue, and the worker's log says so and what to set, once."""
    mode = Mode("dropin", broker_url)
    try:
        worker = worker_factory(APP, pool="threads", env=mode.env()).start(timeout=60)
        mode.send(proj_resume.interrupts)
        line = worker.wait_for_log(r"raised Interrupted, but it was acked when it started.*",
                                   timeout=30).group(0)
        assert "Set task_acks_late (or acks_late=True on the task)" in line
    finally:
        mode.close()


# -- the scripts that move a job, on a real server ---------------------------------------------
def test_only_the_moves_that_end_a_job_drop_its_cursor(redis_client: redis.Redis) -> None:
    """The ack of the run owning the cursor, dead-lettering and a poison pill drop it;
    an ack of another run (the one that retried), a requeue and a recovery keep it."""
    settings = Settings(max_recoveries=0)
    scripts = Scripts(redis_client)
    record = InflightRecord(redis_client, K, "p1")

    def in_flight(tag: str) -> str:
        """Put job ``id-<tag>`` in pool p1's record, its cursor owned by run ``tag``."""
        redis_client.hset(K.inflight("p1"), tag, "q\n" + json.dumps(message(tag, "q")))
        scripts("cursor", [K.cursor(f"id-{tag}")], ["save", tag, '{"at":3}', 60_000])
        return K.cursor(f"id-{tag}")

    def read(key: str, tag: str) -> Any:
        return scripts("cursor", [key], ["read", tag, "", 60_000])

    cursor = in_flight("t1")
    assert 0 < redis_client.pttl(cursor) <= 60_000
    scripts("cursor", [cursor], ["save", "", '{"at":4}', 60_000])  # given up to a retry
    assert record.ack(["t1"]) == 1
    assert read(cursor, "t2") == b'{"at":4}'  # kept: the retry's run t2 owns it now
    redis_client.hset(K.inflight("p1"), "t2", "q\n" + json.dumps(message("t2", "q")) \
        .replace("id-t2", "id-t1"))
    assert record.ack(["t2"]) == 1
    assert not redis_client.exists(cursor)  # the owner's ack

    cursor = in_flight("t3")
    assert record.requeue(["t3"]) == ["t3"]
    assert redis_client.exists(cursor)  # returned (a warm shutdown): kept
    redis_client.delete(K.queue("q"))

    cursor = in_flight("t4")
    assert dead_letter(redis_client, settings, "p1", "t4", reason="failed")
    assert not redis_client.exists(cursor)

    cursor = in_flight("t5")
    redis_client.hset(K.redelivery, "t5", 0)
    _, requeued, dead = recover_tags(redis_client, settings, "p1", ["t5"], mode="job")
    assert dead == ["t5"] and not redis_client.exists(cursor)  # a poison pill

    cursor = in_flight("t6")
    _, requeued, dead = recover_tags(redis_client, Settings(), "p1", ["t6"], mode="job")
    assert requeued == ["t6"] and redis_client.exists(cursor)  # recovered: kept
    assert scripts("cursor", [cursor], ["drop", "t0", "", 0]) == 0  # not its owner
    assert scripts("cursor", [cursor], ["drop", "t6", "", 0]) == 1


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
        job = app.send_task(name, (str(path), KILLED_STEPS, KILLED_PAUSE))
        kill_three_times(path, lambda: worker_factory(
            CLUSTER_APP, broker_url=url, pool="threads", env=env))
        wait_for(lambda: read_steps(path)[2], 90, "the job to finish")
        check_steps(path, KILLED_STEPS, runs=KILLS + 1, redone_at_most=KILLS)
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
