"""The job index (issue 15): a job found by its task id wherever it is, in one read, by
entries the scripts that move the job keep (``celery_ext/job_index.py``).

End-to-end tests run ``tests.proj_index`` / ``tests.proj`` workers, in both modes where
the path differs (``install(app)`` and drop-in); the window and expiry tests build their
jobs through the real producer and scripts on the real server.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import redis

from celery_ext.config import Settings
from celery_ext.dead import dead_letter
from celery_ext.job_index import IndexEntry, lookup
from celery_ext.keys import Keys
from celery_ext.reaper import Reaper
from celery_ext.status import DEAD_SCAN, SCHEDULED_SCAN_MAX, JobLookup, JobStatus
from tests import proj
from tests.helpers import Factory, Mode, start_workers, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes

K = Keys("celery_ext")
FAST = {"CELERY_EXT_HEARTBEAT_INTERVAL": "0.25", "CELERY_EXT_DEAD_AFTER": "1",
        "CELERY_EXT_REAP_INTERVAL": "0.5", "CELERY_EXT_PROMOTE_INTERVAL": "0.5"}


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests import proj_index

    return proj_index


def entry(client: redis.Redis, job_id: str) -> IndexEntry | None:
    return lookup(client, K, job_id)


def until(look: JobLookup, job_id: str, state: str, timeout: float = 15) -> JobStatus:
    """The job's status once it says ``state`` (found by the index)."""
    def check() -> JobStatus | None:
        st = look.status(job_id)
        return st if st["state"] == state and st["indexed"] else None
    return wait_for(check, timeout, f"job {job_id} {state} (now {look.status(job_id)})")


def test_job_followed_from_enqueue_to_done(app: Any, mode: Mode, redis_client: redis.Redis,
                                          rec: redis.Redis, worker_factory: Factory) -> None:
    """scheduled -> promoted (queued) -> fetched, running -> retry -> dead -> dead-retried
    (queued) -> done, the index right at each step."""
    look = JobLookup(redis_client, Settings(), mode.app)
    queue = mode.queue(app.gated)
    rec.set("hold:j", 1)
    result = mode.send(app.gated, "j", countdown=1)
    st = look.status(result.id)
    e = entry(redis_client, result.id)
    assert st["state"] == "scheduled" and e and e["state"] == "scheduled"
    assert e["queue"] == queue and st["due_at"] and st["due_at"] > time.time()
    assert redis_client.zscore(K.scheduled, e["ref"]) is not None

    redis_client.sadd(K.paused, queue)  # promoted but not fetched: it stays queued
    (worker,) = start_workers(worker_factory, 1, app="tests.proj_index",
                              env=mode.env(**FAST))
    st = until(look, result.id, "queued")
    assert (st["queue"], st["level"]) == (queue, 0)

    redis_client.srem(K.paused, queue)
    redis_client.publish(K.wake_channel, queue)
    st = until(look, result.id, "running")
    e = entry(redis_client, result.id)
    assert e and e["state"] == ("done" if mode.dropin else "inflight")  # acked at start
    assert st["pool"] == e["detail"] and redis_client.zscore(K.pools, e["detail"])
    if not mode.dropin:
        assert redis_client.hexists(K.inflight(e["detail"]), e["ref"])

    rec.delete("hold:j")  # fails: retried once, then dead
    st = until(look, result.id, "retrying")
    e = entry(redis_client, result.id)
    assert e and e["state"] == "retry" and redis_client.zscore(K.retry, e["ref"])
    assert st["error"] == "ValueError: j is broken" and st["due_at"]
    st = until(look, result.id, "dead")
    e = entry(redis_client, result.id)
    assert e and st["dead_id"] == e["ref"] and redis_client.hexists(K.dead_jobs, e["ref"])
    assert "j is broken" in (st["error"] or "")

    from celery_ext.client import Client
    client = Client(redis_client)
    redis_client.sadd(K.paused, queue)
    rec.set("heal:j", 1)
    assert client.retry_dead(st["dead_id"] or "")
    st = until(look, result.id, "queued")
    assert st["queue"] == queue and not redis_client.hexists(K.dead_jobs, e["ref"])
    client.resume(queue)
    st = until(look, result.id, "succeeded")
    e = entry(redis_client, result.id)
    assert e and e["state"] == "done" and st["pool"] == e["detail"] and st["result"]
    assert redis_client.zscore(K.job_index_done, result.id)
    worker.stop()


def test_sigkilled_pools_job_is_queued_again_after_the_reaper(
        app: Any, mode: Mode, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    look = JobLookup(redis_client, Settings(), mode.app)
    rec.set("hold:k", 1)
    (victim,) = start_workers(worker_factory, 1, app="tests.proj_index",
                              env=mode.env(acks_late=True, **FAST))
    result = mode.send(app.gated, "k")
    st = until(look, result.id, "running")
    pool = st["pool"]
    redis_client.sadd(K.paused, mode.queue(app.gated))  # requeued, nobody takes it
    victim.stop(signal.SIGKILL)  # the host died: main process and children
    settings = Settings.load({}, environ=FAST)
    wait_for(lambda: Reaper(redis_client, settings).reap_now(force=True).dead_pools, 10,
             "the reaper to declare the pool dead")
    st = look.status(result.id)
    e = entry(redis_client, result.id)
    assert st["state"] == "queued" and e and e["state"] == "queued", (st, e)
    assert not redis_client.hexists(K.inflight(pool or ""), e["ref"])
    assert redis_client.llen(K.queue(mode.queue(app.gated))) == 1
