"""The result backend (``result_backend = "celery-ext://..."``) against real servers and
real ``celery worker`` subprocesses: Celery's result API unchanged, a TTL on every key, one
subscription per waiting client however many results it waits for, results spread over a
cluster's masters.

The broker is the one-node test server (db 0); results go to its db 1 or to the session's
3-master cluster (a namespace per test); tasks record their runs in db 2.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import group
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult, GroupResult

from celery_ext.testing.server import ClusterGroup, RedisServer
from tests import resultutil
from tests.apps import proj_results
from tests.helpers import wait_for
from tests.resultutil import APP, Results
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

# The fixtures every result test uses (a test module's globals are its fixtures).
results, app_for = resultutil.results, resultutil.app_for


def test_result_api_round_trip(results: Results, app_for: Callable[..., WorkerProcess],
                               rec: redis.Redis) -> None:
    """get/ready/state/info/traceback/forget, a custom state, the REVOKED state,
    result_extended and GroupResult save/restore behave as with Celery's own backend."""
    app_for()
    ok = proj_results.add.delay(2, 3)
    assert ok.get(timeout=20) == 5
    assert ok.ready() and ok.successful() and ok.state == "SUCCESS"
    assert ok.name == "tests.apps.proj_results.add" and ok.args == [2, 3]  # result_extended

    bad = proj_results.fail.delay("broken")
    with pytest.raises(ValueError, match="broken"):
        bad.get(timeout=20)
    assert bad.state == "FAILURE" and "ValueError" in (bad.traceback or "")
    assert bad.get(timeout=1, propagate=False).args == ("broken",)

    hold = f"hold:{uuid.uuid4().hex}"
    rec.set(hold, 1)
    slow = proj_results.progress.delay(hold)
    wait_for(lambda: AsyncResult(slow.id, app=proj_results.app).state == "PROGRESS", 20,
             "the PROGRESS state")
    assert AsyncResult(slow.id, app=proj_results.app).info == {"done": 1, "of": 2}
    rec.delete(hold)
    assert slow.get(timeout=20) == "finished"

    saved = group(proj_results.add.s(i, i) for i in range(3)).delay()
    saved.save()
    restored = GroupResult.restore(saved.id, app=proj_results.app)
    assert restored is not None and restored.get(timeout=20) == [0, 2, 4]

    later = proj_results.add.apply_async((1, 1), countdown=2)
    later.revoke()
    with pytest.raises(TaskRevokedError):
        later.get(timeout=30)
    assert later.state == "REVOKED"

    key = results.keys.result(ok.id)
    assert results.client.exists(key)
    ok.forget()
    assert not results.client.exists(key)
    assert AsyncResult(ok.id, app=proj_results.app).state == "PENDING"


def test_every_key_expires(results: Results, app_for: Callable[..., WorkerProcess]) -> None:
    """After results, failures, a saved group and a chord: no key of ours without a TTL,
    even with ``result_expires`` unset (Celery's Redis backend then stores forever)."""
    app_for(env={"CELERY_EXT_TEST_NO_EXPIRES": "1"})
    proj_results.app.conf.result_expires = None
    try:
        proj_results.configure(proj_results.app.conf.broker_url, results.url,
                               proj_results.RECORD_URL, cluster=results.cluster,
                               namespace=results.namespace)
        done = group(proj_results.add.s(i, 1) for i in range(20)).delay()
        done.save()
        assert done.get(timeout=30) == [i + 1 for i in range(20)]
        with pytest.raises(ValueError):
            proj_results.fail.delay("x").get(timeout=20)
        from celery import chord

        assert chord(proj_results.part.s(i) for i in range(5))(
            proj_results.total.s()).get(timeout=30) == 10
    finally:
        proj_results.app.conf.result_expires = 3600
    keys = results.our_keys()
    assert len(keys) >= 22
    without = [k for k in keys if results.ttl(k) < 0]
    assert without == []
    if results.cluster:  # results keyed by their own task id: on every master
        masters = {results.client.get_node_from_key(k).name for k in keys}
        assert len(masters) == 3


def test_one_subscription_for_a_group_of_500(
        results: Results, app_for: Callable[..., WorkerProcess]) -> None:
    """A client waiting on a group of 500 holds one channel (Celery's Redis backend: 501)."""
    app_for(concurrency=4)
    backend = proj_results.app.backend
    res = group(proj_results.add.s(i, 0) for i in range(500)).delay()
    assert _our_channels(results) == []  # sending subscribes to nothing
    assert res.get(timeout=120) == list(range(500))
    assert _our_channels(results) == [results.keys.wake_channel(proj_results.app.thread_oid)]
    assert backend.result_consumer._pending == set()


def _stored(backend: Any, ids: list[str]) -> list[Any] | None:
    """The stored results of ``ids`` read afresh (None while the cluster settles)."""
    try:
        return [backend.get_task_meta(t, cache=False)["result"] for t in ids]
    except backend.connection_errors:
        return None


def _our_channels(results: Results) -> list[str]:
    """The pub/sub channels of this namespace with a subscriber, on every node."""
    pattern = "{" + results.namespace + ":*"
    if results.cluster:
        out: list[str] = []
        for node in results.client.get_primaries():
            conn = results.client.get_redis_connection(node)
            out += [c.decode() for c in conn.execute_command("PUBSUB", "SHARDCHANNELS",
                                                             pattern)]
        return out
    return [c.decode() for c in results.client.pubsub_channels(pattern)]


def test_wakeup_delivers_without_polling(results: Results, rec: redis.Redis,
                                         app_for: Callable[..., WorkerProcess],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's publish to the client's channel alone finishes a get(): with the
    re-read turned off, a result stored after get() began still arrives."""
    import threading

    from celery_ext.results.consumer import WakeupConsumer

    app_for()
    monkeypatch.setattr(WakeupConsumer, "_poll", lambda self: None)
    hold = f"hold:{uuid.uuid4().hex}"
    rec.set(hold, 1)
    res = proj_results.part.delay(7, hold)
    wait_for(lambda: rec.get("part_runs:7"), 20, "the job to start")
    threading.Timer(0.3, rec.delete, args=(hold,)).start()
    assert res.get(timeout=20) == 7


def test_a_shared_backend_subscribes_every_waiting_thread(
        results: Results, rec: redis.Redis, app_for: Callable[..., WorkerProcess],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend shared by threads (``result_backend_thread_safe``) listens on every waiting
    thread's channel, on a cluster on the shard of each: with the re-read turned off, every
    thread's result arrives by its wake-up."""
    import threading

    from celery_ext.results.consumer import WakeupConsumer

    app_for()
    app = proj_results.app
    monkeypatch.setattr(WakeupConsumer, "_poll", lambda self: None)
    monkeypatch.setitem(app.conf, "result_backend_thread_safe", True)
    monkeypatch.setattr(app, "_backend_cache", None)  # restored: per-thread backends again
    backend = app._get_backend()
    app._backend = backend  # thread-safe: one backend, shared by every thread
    hold = f"hold:{uuid.uuid4().hex}"
    rec.set(hold, 1)
    got: dict[int, Any] = {}
    oids: list[str] = []

    def wait_on(i: int) -> None:
        oids.append(app.thread_oid)
        got[i] = proj_results.part.delay(i, hold).get(timeout=30)

    threads = [threading.Thread(target=wait_on, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(oids) == 8 and sorted(_our_channels(results)) == sorted(
            results.keys.wake_channel(o) for o in oids), 30,
            "every waiting thread's channel subscribed")
        if results.cluster:  # 8 random channels on 3 masters: on more than one
            shards = {results.client.get_node_from_key(results.keys.wake_channel(o)).name
                      for o in oids}
            assert len(shards) > 1, "every channel fell on one shard: run again"
        rec.delete(hold)
        for t in threads:
            t.join(40)
        assert got == {i: i for i in range(8)}
    finally:
        rec.delete(hold)
        backend.result_consumer.stop()


def test_a_cluster_master_failover_while_a_client_waits(
        results: Results, app_for: Callable[..., WorkerProcess], rec: redis.Redis,
        request: pytest.FixtureRequest) -> None:
    """The master holding a waiting client's wake-up channel is killed while the client
    waits on a group: its replica takes over, the client subscribes there again (or reads),
    and get() returns every result; results stored (and replicated) before the kill are
    all there afterwards."""
    import threading

    if not results.cluster:
        pytest.skip("a cluster master's failover")
    cluster: ClusterGroup = request.getfixturevalue("cluster")
    app_for()
    p = proj_results
    before = group(p.add.s(i, 0) for i in range(50)).delay()
    assert before.get(timeout=30) == list(range(50))
    for master in cluster.master_servers():  # replicated before the kill:
        # a write of this connection, then WAIT (it covers every earlier write: a WAIT
        # on a connection that wrote nothing returns at once).
        key = next(k for k in (f"barrier{{{i}}}" for i in range(10_000))
                   if cluster.master_of(k) is master)
        with master.client() as c:
            c.set(key, 1, ex=60)
            assert c.wait(1, 5000) == 1
    channel = results.keys.wake_channel(p.app.thread_oid)
    victim = cluster.master_of(channel)
    hold = f"hold:{uuid.uuid4().hex}"
    rec.set(hold, 1)
    waiting = group(p.part.s(i, hold) for i in range(4)).delay()

    def fail_over() -> None:
        time.sleep(1.0)  # the client is waiting by now
        cluster.kill_master(victim)
        cluster.wait_promoted(victim)
        rec.delete(hold)

    mover = threading.Thread(target=fail_over)
    mover.start()
    try:
        assert waiting.get(timeout=90) == [0, 1, 2, 3]
        mover.join()
        backend = p.app.backend
        assert wait_for(lambda: _stored(backend, [r.id for r in before.results]), 30,
                        "the results stored before the kill") == list(range(50))
    finally:
        mover.join()
        rec.delete(hold)
        victim.start()  # it rejoins as a replica of the promoted one
        wait_for(lambda: cluster.healthy() and len(cluster.replica_servers()) == 3, 30,
                 "the killed master to rejoin as a replica")


def test_a_get_costs_no_extra_round_trip(redis_server: RedisServer, rec: redis.Redis,
                                         worker_factory: Callable[..., WorkerProcess]) -> None:
    """Issue 34: on a results server of the test's own, sequential get()s of one thread
    cost per job the worker's stores (Celery's read of the old meta, the write, the
    wake-up publish; for STARTED too with ``task_track_started``) and one read by the
    client: no second subscription, no unsubscribe, no re-read (MGET) unless a get()
    went a whole ``RESULT_POLL_INTERVAL`` without its wake-up."""
    from celery_ext.config import RESULT_POLL_INTERVAL

    gets = 20
    with RedisServer() as server:
        url = server.url(scheme="celery-ext", db=1)
        broker = redis_server.url(scheme="celery-ext")
        record = redis_server.url(db=2)
        namespace = "r" + uuid.uuid4().hex[:8]
        proj_results.configure(broker, url, record, namespace=namespace)
        worker_factory(APP, broker_url=broker, env={
            "CELERY_EXT_RESULT_URL": url, "CELERY_EXT_RECORD_URL": record,
            "CELERY_EXT_RESULT_NAMESPACE": namespace, "CELERY_EXT_RESULT_CLUSTER": "0",
        }).start(timeout=60)
        assert proj_results.add.delay(0, 0).get(timeout=30) == 0  # subscribed from here
        control = server.client()

        def calls() -> dict[str, int]:
            return {k.removeprefix("cmdstat_"): int(v["calls"])
                    for k, v in control.info("commandstats").items()}

        before = calls()
        slow = 0
        for i in range(gets):
            t0 = time.monotonic()
            assert proj_results.add.delay(i, 1).get(timeout=30) == i + 1
            slow += time.monotonic() - t0 >= RESULT_POLL_INTERVAL
        after = calls()
    spent = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    spent.pop("info", None)
    for setup in ("client|setinfo", "hello", "select", "ping"):  # a new connection's
        spent.pop(setup, None)
    stores = 2 if proj_results.app.conf.task_track_started else 1
    assert spent.pop("mget", 0) <= slow
    assert spent == {"get": gets * (stores + 1), "set": gets * stores,
                     "publish": gets * stores}
