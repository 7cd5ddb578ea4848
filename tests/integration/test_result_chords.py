"""Chords on the result backend, with real workers, on one node and a 3-master cluster:
Celery's canvas semantics (chords, a chain into a chord, nested chords, error callbacks),
and a header job run twice (its pool SIGKILLed after the job counted, before its ack)
counting once, so the body runs exactly once with the right result.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import chain, chord, group

from celery_ext.config import Settings
from celery_ext.store.keys import Keys
from tests import resultutil
from tests.apps import proj_results
from tests.helpers import celery_cli, message, wait_for
from tests.resultutil import Results
from tests.workers import WorkerProcess

K = Keys("celery_ext")

results, app_for = resultutil.results, resultutil.app_for
APP = resultutil.APP

#: Pools declared dead within about two seconds (the reaper of the surviving pool).
FAST_REAP = {"CELERY_EXT_HEARTBEAT_INTERVAL": "0.3", "CELERY_EXT_DEAD_AFTER": "1.5",
             "CELERY_EXT_REAP_INTERVAL": "0.3"}


def test_canvas_semantics(results: Results, app_for: Callable[..., WorkerProcess],
                          rec: redis.Redis) -> None:
    app_for(concurrency=4)
    p = proj_results
    res = chord(p.part.s(i) for i in range(10))(p.total.s())
    assert res.get(timeout=30) == 45
    assert int(rec.get(f"body_calls:{res.parent.id}") or 0) <= 1  # the body's group is its own
    state = results.client.hgetall(results.keys.chord(res.parent.id))
    assert state[b"state"] == b"sent" and state[b"counted"] == b"10"
    assert not results.client.exists(results.keys.chord_ids(res.parent.id))

    # A chain into a chord, and a chord whose header holds a chord (nested).
    assert chain(p.add.s(1, 1), chord([p.add.s(1), p.add.s(2)], p.total.s())).delay(
        ).get(timeout=30) == 3 + 4
    inner = chord([p.part.s(1), p.part.s(2)], p.total.s())
    assert chord([inner, p.part.s(10)], p.total.s()).delay().get(timeout=30) == 13
    assert chord(group(p.part.s(i) for i in range(3)), p.total.s()).delay().get(
        timeout=30) == 3


def test_header_failure_calls_the_error_callback(
        results: Results, app_for: Callable[..., WorkerProcess], rec: redis.Redis) -> None:
    """A failed header job fails the chord through the body's link_error, with the
    reason; the body never runs."""
    app_for()
    p = proj_results
    body = p.total.s().on_error(p.on_error.s())
    res = chord([p.part.s(1), p.fail.s("header broke"), p.part.s(2)])(body)
    errors = wait_for(lambda: rec.lrange("errors", 0, -1), 30, "the error callback")
    assert len(errors) == 1 and b"header broke" in errors[0] and b"ChordError" in errors[0]
    wait_for(lambda: res.state == "FAILURE", 10, "the body's FAILURE (after its errback)")
    assert not rec.get("body_calls")
    state = results.client.hgetall(results.keys.chord(res.parent.id))
    assert state[b"state"] == b"failed" and b"header broke" in state[b"error"]


def test_header_job_run_twice_counts_once(
        results: Results, app_for: Callable[..., WorkerProcess], rec: redis.Redis) -> None:
    """A header job's pool is SIGKILLed after the job stored its result and counted it,
    before the ack: the job runs again on the other pool. Counting by task id, the chord
    waits for its real last job and calls the body once, with every header result."""
    for _ in range(2):
        app_for(env=FAST_REAP, concurrency=2)
    p = proj_results
    hold = f"hold:{uuid.uuid4().hex}"
    rec.set(hold, 1)
    res = chord([p.part.s(1), p.part_then_die.s(2), p.part.s(3, hold)])(p.total.s())
    wait_for(lambda: int(rec.get("postrun:2") or 0) >= 2, 60,
             "the killed header job to run again and finish")
    assert not rec.get("body_calls")  # the count is 2 of 3: job 3 is still held
    rec.delete(hold)
    assert res.get(timeout=60) == 6
    wait_for(lambda: rec.get("body_calls"), 10, "the body's record")
    assert int(rec.get("body_calls") or 0) == 1


def test_body_published_then_pool_killed_runs_the_body_once(
        results: Results, app_for: Callable[..., WorkerProcess], rec: redis.Redis) -> None:
    """A chord's header job's pool is SIGKILLed right after it published the chord's body,
    before the chord was marked done: the job runs again on the other pool and publishes
    the body again, which the enqueue script finds already written. The body runs once."""
    for _ in range(2):
        app_for(env=FAST_REAP, concurrency=1)
    p = proj_results
    res = chord([p.part_dies_after_body.s(2)])(p.total.s())
    assert res.get(timeout=60) == 2
    wait_for(lambda: results.client.hget(results.keys.chord(res.parent.id), "state") == b"sent",
             60, "the header job's second run to settle the chord")
    assert int(rec.get("part_runs:2") or 0) == 2 and rec.get(
        f"body_published:{res.parent.results[0].id}") == b"2"
    # One worker is left, running one job at a time in queue order: a second body, pushed
    # before the chord was settled, runs before this job's result comes back.
    assert p.add.delay(1, 1).get(timeout=60) == 2
    assert int(rec.get("body_calls") or 0) == 1


def test_header_job_in_the_dead_set_fails_the_chord(
        results: Results, app_for: Callable[..., WorkerProcess], rec: redis.Redis) -> None:
    """A header job that kills its pool on every run goes to the dead set as a poison
    pill, which Celery never sees: its result fails with the reason (a get() does not
    wait forever) and its chord fails through the body's error callback."""
    env = {**FAST_REAP, "CELERY_EXT_MAX_RECOVERIES": "0"}
    workers = [app_for(env=env) for _ in range(2)]
    p = proj_results
    body = p.total.s().on_error(p.on_error.s())
    res = chord([p.part.s(1), p.kill_pool.s(2)])(body)
    errors = wait_for(lambda: rec.lrange("errors", 0, -1), 60, "the chord's error callback")
    assert len(errors) == 1 and b"DeadJob" in errors[0] and b"worker_lost" in errors[0]
    dead_job = next(r for r in res.parent.results if r.state == "FAILURE")
    assert "worker_lost" in str(dead_job.result)
    wait_for(lambda: res.state == "FAILURE", 10, "the body's FAILURE")
    assert not rec.get("body_calls")
    assert any(w.alive for w in workers)


def test_pending_chords_are_visible(results: Results, app_for: Callable[..., WorkerProcess],
                                    rec: redis.Redis) -> None:
    """A chord waiting for a held header job shows "1 of 2" in Client, the CLI and the
    dashboard's API, and leaves the list once its body was sent."""
    import json
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    from celery_ext.admin.web import create_app
    from celery_ext.client import Client

    worker = app_for()
    p = proj_results
    hold = f"hold:{uuid.uuid4().hex}"
    rec.set(hold, 1)
    res = chord([p.part.s(1), p.part.s(2, hold)])(p.total.s())
    gid = res.parent.id
    client = Client.from_app(p.app)
    pending = wait_for(lambda: [c for c in client.pending_chords() if c["counted"] == 1],
                       30, "the chord counted 1 of 2")
    assert [(c["group_id"], c["counted"], c["size"]) for c in pending] == [(gid, 1, 2)]

    cli = celery_cli("-A", APP, "ext", "chords", "--json", broker_url=worker.broker_url,
                     env=worker.env)
    assert cli.returncode == 0, cli.stderr
    assert [(c["group_id"], c["counted"], c["size"]) for c in json.loads(cli.stdout)] == [
        (gid, 1, 2)]
    with TestClient(create_app(client, sample_interval=0.5)) as api:
        shown = api.get("/api/chords").json()["items"]
        assert [(c["group_id"], c["counted"]) for c in shown] == [(gid, 1)]
        assert api.get("/chords").status_code == 200

    rec.delete(hold)
    assert res.get(timeout=30) == 3
    assert client.pending_chords() == []


def test_gevent_worker_shares_one_backend(results: Results,
                                          app_for: Callable[..., WorkerProcess]) -> None:
    """Under ``-P gevent`` the greenlets share the backend: the connections made while 120
    jobs store their results stay about the concurrency's (one backend per job, as Celery
    makes by default, connects anew for each), and a group and a chord come back whole."""
    worker = app_for(pool="gevent", concurrency=20)
    p = proj_results
    made = _connections_made(results)
    assert group(p.add.s(i, i) for i in range(100)).delay().get(timeout=60) == [
        2 * i for i in range(100)]
    assert chord(p.part.s(i) for i in range(20))(p.total.s()).get(timeout=60) == 190
    assert worker.alive
    assert _connections_made(results) - made < 60


def _connections_made(results: Results) -> int:
    """Connections the results' server(s) accepted so far."""
    if results.cluster:
        infos = results.client.info("stats", target_nodes=results.client.PRIMARIES)
        return sum(int(i["total_connections_received"]) for i in infos.values())
    return int(results.client.info("stats")["total_connections_received"])


def test_a_result_backend_that_is_away_does_not_hold_up_a_dead_letter(
        redis_client: redis.Redis) -> None:
    """The dead set's listener stores the failure of a job it takes in, from the thread
    that moved it (the reaper's, the fetch's). With the app's result backend away and
    Celery's retry on (``install(app)`` sets ``result_backend_always_retry``; its retries
    are unbounded by default), that store is tried once and the failure logged: before,
    the reaper's pass waited on Celery's retries for as long as the backend was away."""
    import socket
    import threading

    from celery import Celery

    from celery_ext.store import dead_set
    from celery_ext.worker.reaper import Reaper

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = Celery("away", broker=f"celery-ext://127.0.0.1:{port}/0",
                 backend=f"celery-ext://127.0.0.1:{port}/1", set_as_current=False)
    app.conf.result_backend_always_retry = True
    listeners = list(dead_set._listeners)
    app.backend  # noqa: B018 (made in this thread: it registers its dead-set listener)
    try:
        settings = Settings()
        pool, queue = "ghost:1:away", "tests.away"
        redis_client.zadd(K.pools, {pool: 0})
        redis_client.hset(K.pool(pool), "dead_after_ms", 1000)
        redis_client.sadd(K.inflight_pools, pool)
        redis_client.hset(K.inflight(pool), "t1", f"{queue}\n{json.dumps(message('t1', queue))}")
        redis_client.hset(K.redelivery, "t1", settings.max_recoveries)  # a poison pill
        done: list[Any] = []
        reaper = threading.Thread(
            target=lambda: done.append(Reaper(redis_client, settings).reap()), daemon=True)
        reaper.start()
        reaper.join(60)  # (Celery's retries would wait until the backend came back)
        assert done and done[0].dead_jobs == ["t1"], "the reaper's pass did not end"
        assert redis_client.zcard(K.dead) == 1
    finally:
        dead_set._listeners[:] = listeners
        app.close()
