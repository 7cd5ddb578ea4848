"""The dead set and the retry set (issue 4): why jobs die, and the client API on them.

End-to-end tests run ``tests.apps.proj_sets`` workers, once with ``install(app)`` and once
drop-in (the ``mode`` fixture: only the broker URL changed, a stock Celery app sends
to the ``celery`` queue); the client API tests build dead and scheduled records
in-process on the real server.
"""

from __future__ import annotations

import base64
import itertools
import json
import signal
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from celery_ext.client import Client
from celery_ext.config import Settings
from celery_ext.options.backoff import Backoff, backoff_for
from celery_ext.producer.scheduled import schedule
from celery_ext.store.compact import unpack
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts, sha
from tests.apps import proj
from tests.helpers import Factory, Mode, message, start_workers, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_sets

    return proj_sets


@pytest.fixture
def client(redis_client: redis.Redis) -> Client:
    return Client(redis_client)


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "pool"), [("install", "prefork"), ("dropin", "prefork"),
                                            ("install", "gevent")], indirect=["mode"])
def test_failing_job_retries_then_dies_with_traceback_and_retry_from_dead_runs_it(
        app: Any, mode: Mode, pool: str, client: Client, rec: redis.Redis,
        worker_factory: Factory) -> None:
    (worker,) = start_workers(worker_factory, 1, pool=pool, env=mode.env())
    result = mode.send(app.flaky, "f")
    backing = mode.send(app.backing_off, "b")

    # While it waits for its retry, it is in the retry set with attempt and last error.
    (retry,) = wait_for(lambda: client.retries(name="tests.apps.proj_sets.flaky")["items"], 10,
                        "the retry in the retry set")
    assert retry["task_id"] == result.id and retry["retry"] and retry["attempt"] == 1
    assert retry["error"] == "ValueError: f is broken" and "is broken" in retry["traceback"]
    assert retry["due_at"] > time.time() and retry["args"] == ["f"]

    # Out of retries: the dead set, with everything a person needs.
    (dead,) = wait_for(lambda: client.dead(name="tests.apps.proj_sets.flaky")["items"], 10,
                       "the job in the dead set")
    assert rec.llen("runs:f") == 2  # first attempt + one retry
    assert dead["reason"] == "failed" and dead["task_id"] == result.id
    assert (dead["exc_type"], dead["exc_message"]) == ("ValueError", "f is broken")
    assert 'raise ValueError(f"{key} is broken")' in (dead["traceback"] or "")
    assert (dead["args"], dead["kwargs"], dead["attempts"]) == (["f"], {}, 2)
    assert dead["hostname"] == worker.hostname.replace("%h", socket.gethostname())
    assert dead["pool"] and dead["pool"].startswith(socket.gethostname())
    assert abs(dead["failed_at"] - time.time()) < 5
    assert client.dead_job(dead["id"])["payload"]  # type: ignore[index]
    assert result.state == "FAILURE"

    # A person fixes the cause and retries it: it runs again, attempts reset.
    rec.set("heal:f", 1)
    assert client.retry_dead(dead["id"]) is True
    assert client.retry_dead(dead["id"]) is False  # pressed twice: requeued once
    meta = wait_for(lambda: (m := mode.app.backend.get_task_meta(result.id, cache=False))
                    ["status"] == "SUCCESS" and m, 10, "the retried job to succeed")
    assert meta["result"] == "healed"
    runs = [r.decode() for r in rec.lrange("runs:f", 0, -1)]
    assert len(runs) == 3 and runs[-1].endswith(":0")
    assert client.dead(name="tests.apps.proj_sets.flaky")["total"] == 0

    # The opt-in backoff chose the retry delays: 0.2 s, then 0.4 s (jitter 0).
    wait_for(lambda: client.dead(name="tests.apps.proj_sets.backing_off")["total"], 10,
             "the backing-off job in the dead set")
    times = [float(t) for t in rec.lrange("runs:b", 0, -1)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 3 and 0.19 < gaps[0] < 0.45 and 0.39 < gaps[1] < 0.65, gaps
    dead = client.dead(name="tests.apps.proj_sets.backing_off")["items"]
    assert dead[0]["exc_type"] == "KeyError"
    assert backing.state == "FAILURE"


def test_unknown_task_and_garbage_land_in_dead_set_worker_keeps_going(
        app: Any, mode: Mode, client: Client, redis_client: redis.Redis,
        worker_factory: Factory) -> None:
    """Stock Celery logs and drops these; here each one is dead with its reason."""
    start_workers(worker_factory, 1, env=mode.env())
    queue = mode.queue(proj.add)
    unknown = mode.app.send_task("tests.no_such_task", args=(1,), queue=queue)
    redis_client.lpush(K.queue(queue), b"\x00 this is not a message")
    bad_body = {  # a kombu envelope whose JSON body does not parse
        "body": base64.b64encode(b"{not json").decode(), "content-encoding": "utf-8",
        "content-type": "application/json", "headers": {},
        "properties": {"delivery_tag": "bad-body-1", "body_encoding": "base64",
                       "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0},
    }
    redis_client.lpush(K.queue(queue), json.dumps(bad_body))
    assert mode.send(proj.add, 2, 3).get(timeout=10) == 5

    page = wait_for(lambda: (p := client.dead())["total"] == 3 and p, 10, "three dead jobs")
    by_reason = sorted((j["reason"], j["name"]) for j in page["items"])
    assert by_reason == [("undecodable", queue), ("undecodable", queue),
                         ("unknown_task", "tests.no_such_task")]
    unknown_job = next(j for j in page["items"] if j["reason"] == "unknown_task")
    assert unknown_job["task_id"] == unknown.id and "NotRegistered" in unknown_job["error"]
    assert {j["id"] for j in page["items"] if j["reason"] == "undecodable"} >= {"bad-body-1"}
    assert mode.send(proj.add, 4, 5).get(timeout=10) == 9  # and it keeps going
    wait_for(lambda: int(redis_client.hget(K.running, queue) or 0) == 0, 5,
             "no job of the queue in flight")


# -- client API on the dead set ------------------------------------------------------------------



def test_job_failing_during_a_cold_shutdown_is_not_lost(
        app: Any, mode: Mode, client: Client, rec: redis.Redis,
        redis_client: redis.Redis, worker_factory: Factory) -> None:
    """A job that fails while its worker shuts down cold (SIGQUIT) is accounted for: one
    acked when it ends (``install(app)``'s default) goes back to the front of its queue,
    since the shutdown may be why it failed, and the next pool runs it again, after which
    its own failure lands in the dead set; one acked when it started (drop-in) goes to
    the dead set with its reason. Celery acks such a job and records no failure. (A
    threads pool lets the job run on; a cold shutdown kills prefork children.)"""
    (worker,) = start_workers(worker_factory, 1, pool="threads", env=mode.env())
    mode.send(app.fails_late, "cold", 2.0)
    wait_for(lambda: rec.llen("start:cold"), 10, "the job to start")
    worker.stop(signal.SIGQUIT, timeout=30)
    assert rec.llen("runs:cold") == 1  # it failed while its worker shut down
    queued = {q["name"]: q["size"] for q in client.job_queues()}.get(mode.queue(app.fails_late), 0)
    if mode.dropin:
        (dead,) = client.dead()["items"]
        assert dead["reason"] == "failed" and dead["error"] == "ValueError: cold fails"
        assert queued == 0
        return
    assert (queued, client.counts()["dead"]) == (1, 0)
    start_workers(worker_factory, 1, pool="threads", env=mode.env())
    (dead,) = wait_for(lambda: client.dead()["items"], 15, "the rerun's failure in the dead set")
    assert dead["reason"] == "failed" and rec.llen("runs:cold") == 2

def _payload(tag: str, task: str, args: list[Any]) -> str:
    body = base64.b64encode(json.dumps([args, {}, {}]).encode()).decode()
    msg = message(tag, task, retries=2)
    msg["body"] = body
    msg["headers"].update(eta="2020-01-01T00:00:00+00:00", expires="2020-01-01T00:00:01+00:00")
    return json.dumps(msg)


def _kill(redis_client: redis.Redis, settings: Settings, tag: str, task: str,
          args: list[Any] | None = None) -> None:
    """Put a job in flight in pool p1, then dead-letter it as a failure."""
    redis_client.hset(K.inflight("p1"), tag, f"{task}\n{_payload(tag, task, args or [tag])}")
    redis_client.hincrby(K.running, task, 1)
    assert dead_letter(redis_client, settings, "p1", tag, reason="failed", error="E: x",
                       name=task, exc_type="E")


def test_dead_set_list_show_filter_page(redis_client: redis.Redis, client: Client) -> None:
    s = Settings()
    for i in range(7):
        _kill(redis_client, s, f"t{i}", "job.a" if i % 2 else "job.b")
    assert int(redis_client.hget(K.running, "job.a") or 0) == 0
    page = client.dead(offset=0, limit=3)
    assert page["total"] == 7 and [j["id"] for j in page["items"]] == ["t6", "t5", "t4"]
    page = client.dead(offset=1, limit=2, name="job.a")
    assert page["total"] == 3 and [j["id"] for j in page["items"]] == ["t3", "t1"]
    job = client.dead_job("t3")
    assert job is not None and job["name"] == "job.a" and job["args"] == ["t3"]
    assert job["reason"] == "failed" and job["payload"] and job["attempts"] == 3
    assert client.dead_job("nope") is None
    assert client.counts() == {"scheduled": 0, "retry": 0, "dead": 7}


def test_dead_retry_is_atomic_and_idempotent(redis_server: Any, redis_client: redis.Redis,
                                            client: Client) -> None:
    """Ten people press "retry" on the same dead job at once: it is requeued once."""
    s = Settings()
    _kill(redis_client, s, "r1", "job.a")
    redis_client.lpush(K.queue("job.a"), "older")
    ok: list[bool] = []
    barrier = threading.Barrier(10)

    def press() -> None:
        c = Client(redis_server.client())
        barrier.wait()
        ok.append(c.retry_dead("r1"))

    threads = [threading.Thread(target=press) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ok) == [False] * 9 + [True]
    assert redis_client.llen(K.queue("job.a")) == 2
    front = unpack(redis_client.lindex(K.queue("job.a"), -1), "job.a")  # fetched next
    headers = front["headers"]
    assert front["properties"]["delivery_tag"] == "r1"
    assert (headers["retries"], headers["eta"], headers["expires"]) == (0, None, None)
    assert headers["celery_ext_manual_retries"] == 1
    assert redis_client.sismember(K.ready, "job.a") and client.counts()["dead"] == 0


def test_dead_retry_all_and_delete(redis_client: redis.Redis, client: Client) -> None:
    s = Settings()
    for i in range(6):
        _kill(redis_client, s, f"d{i}", "job.a" if i < 4 else "job.b")
    assert client.retry_all_dead(name="job.b") == 2
    assert redis_client.llen(K.queue("job.b")) == 2
    assert client.delete_dead("d0") is True and client.delete_dead("d0") is False
    assert client.delete_all_dead(name="job.a") == 3
    _kill(redis_client, s, "d9", "job.c")
    assert client.delete_all_dead() == 1
    assert client.counts()["dead"] == 0 and redis_client.hlen(K.dead_jobs) == 0
    assert client.retry_all_dead() == 0


def test_dead_set_is_bounded_oldest_trimmed_first(redis_client: redis.Redis,
                                                  client: Client) -> None:
    small = Settings(dead_max_size=3)
    for i in range(5):
        _kill(redis_client, small, f"b{i}", "job.a")
    assert [j["id"] for j in client.dead()["items"]] == ["b4", "b3", "b2"]
    assert redis_client.hlen(K.dead_jobs) == 3
    young = Settings(dead_max_age=0.05)
    time.sleep(0.1)
    _kill(redis_client, young, "b9", "job.a")
    assert [j["id"] for j in client.dead()["items"]] == ["b9"]



def test_jobs_dead_in_one_millisecond_are_listed_and_trimmed_in_the_order_they_died(
        redis_client: redis.Redis, client: Client) -> None:
    """Twelve jobs dead-lettered in one pipeline (the same millisecond, their ids in the
    reverse order of their death) with room for five: the five kept are the last five to
    die, listed newest first, and a job killed as a poison pill by the recovery in the
    same millisecond comes after them. What a person sees is what the trim keeps."""
    small = Settings(dead_max_size=5)
    tags = [f"dead-{chr(ord('z') - i)}" for i in range(12)]
    for tag in tags:
        redis_client.hset(K.inflight("p1"), tag, f"job.a\n{_payload(tag, 'job.a', [tag])}")
    pill = "dead-a"
    redis_client.hset(K.inflight("p1"), pill, f"job.a\n{_payload(pill, 'job.a', [pill])}")
    redis_client.hset(K.redelivery, pill, small.max_recoveries)
    recover = ([K.inflight("p1"), K.pools, K.pool("p1"), K.inflight_pools, K.ready,
                K.redelivery, K.running, K.dead, K.dead_jobs, K.job_index,
                K.job_index_done, K.queue("job.a")],
               ["p1", "job", 0, K.wake_channel, K.queue(""), small.max_recoveries,
                small.dead_max_size, "worker lost", 0, K.cursor_prefix, pill])
    Scripts(redis_client).load_all()  # (EVALSHA in a pipeline)
    with redis_client.pipeline(transaction=False) as pipe:
        for tag in tags:
            pipe.evalsha(sha("dead"), 9, K.inflight("p1"), K.dead, K.dead_jobs,
                         K.redelivery, K.running, K.limits, K.ready, K.job_index,
                         K.job_index_done, tag, '{"reason": "failed"}',
                         small.dead_max_size, int(small.dead_max_age * 1000), "",
                         K.wake_channel, 0)
        pipe.evalsha(sha("recover"), len(recover[0]), *recover[0], *recover[1])
        replies = pipe.execute()
    assert replies[:-1] == [1] * len(tags) and replies[-1][2] == [pill.encode()]
    newest = [pill, *reversed(tags[-4:])]
    assert [j["id"] for j in client.dead(limit=10)["items"]] == newest
    assert redis_client.hlen(K.dead_jobs) == 5

# -- client API on the scheduled and retry sets ----------------------------------------------


def test_scheduled_and_retry_sets_listing(redis_client: redis.Redis, client: Client) -> None:
    scripts = Scripts(redis_client)
    schedule(scripts, K, "job.a", message("s1", "job.a"), 60_000, redis_client)
    try:
        raise RuntimeError("database is down")
    except RuntimeError:
        # As Task.retry does: publish the retry inside the except block.
        schedule(scripts, K, "job.a", message("r1", "job.a", retries=3), 30_000, redis_client)
    (plain,) = client.scheduled()["items"]
    assert plain["id"] == "s1" and not plain["retry"] and plain["attempt"] == 0
    assert 59 < plain["due_at"] - time.time() <= 60 and plain["scheduled_at"]
    (retry,) = client.retries()["items"]
    assert retry["retry"] and retry["attempt"] == 3 and retry["task_id"] == "id-r1"
    assert retry["error"] == "RuntimeError: database is down"
    assert "database is down" in (retry["traceback"] or "")
    assert client.retries(name="job.b")["total"] == 0
    assert client.delete_scheduled("s1") is True and client.delete_scheduled("s1") is False
    assert client.run_scheduled_now("r1") is True
    assert redis_client.zscore(K.retry, "r1") == 0


def test_backoff_is_exponential_capped_and_jittered() -> None:
    b = Backoff(base=2, max=60, jitter=0.25)
    assert [b.delay(n, rand=lambda: 0.0) for n in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    assert b.delay(3, rand=lambda: 1.0) == 16 * 0.75
    with pytest.raises(ValueError):
        Backoff(base=0, max=1, jitter=0)

    task = SimpleNamespace(name="t", backoff={"base": 1, "max": 5})
    assert backoff_for(task, Settings()) == Backoff(1.0, 5.0, Settings().retry_backoff_jitter)
    task.backoff = "fast"
    with pytest.raises(ValueError, match="backoff="):
        backoff_for(task, Settings())
