"""The namespace-wide parts on a Redis Cluster (issue 13, docs/cluster.md): the reaper,
the requeuer, the dead set, pause and limits, and the client-side views, over job
queues whose copies of the layout (``Keys.of(queue)``) land on all three masters.

No workers here: the scripts are driven through a RedisCluster client on each queue's
copy, as the transport does."""

from __future__ import annotations

import json
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from kombu.utils.encoding import bytes_to_str
from prometheus_client import generate_latest

from celery_ext.admin.metrics import registry_for
from celery_ext.admin.search import Filters
from celery_ext.admin.web import create_app
from celery_ext.client import Client
from celery_ext.options.limits import write_limits
from celery_ext.producer.periodic_run import PeriodicRun, run_id, run_marker, write_run_apart
from celery_ext.producer.scheduled import schedule_args
from celery_ext.store.copies import copies, known_queues
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup
from celery_ext.worker.reaper import Reaper
from celery_ext.worker.requeuer import Requeuer
from tests.helpers import celery_cli, message

with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

#: Jobs of each queue in the tests below.
PER_QUEUE = 3


@pytest.fixture
def cc(cluster_url: str) -> Iterator[Client]:
    """A client of a namespace of this test's own on the shared cluster."""
    client = Client.from_url(cluster_url, cluster=True, namespace=f"c2_{uuid.uuid4().hex[:8]}")
    try:
        yield client
    finally:
        client.client.close()


def spread_queues(cluster: ClusterGroup, keys: Keys, n: int = 6) -> list[str]:
    """``n`` job queue names whose copies land on all three masters (two on each)."""
    picked: dict[int, list[str]] = {}
    i = 0
    while sum(len(v) for v in picked.values()) < n:
        name = f"tasks.job{i}"
        i += 1
        port = cluster.master_of(keys.of(name).queue(name)).port
        if len(picked.setdefault(port, [])) < n // 3:
            picked[port].append(name)
    assert len(picked) == 3
    return sorted(q for names in picked.values() for q in names)


def enqueue(cc: Client, queue: str, tag: str) -> None:
    """A producer's enqueue on a cluster: the script on the queue's copy, and the queue
    in the home registry."""
    k = cc.keys.of(queue)
    cc.scripts("enqueue", [k.queue(queue), k.ready, k.queues],
               [json.dumps(message(tag, queue)), queue, k.wake_channel, 0])
    cc.client.sadd(cc.keys.queues, queue)


def register(cc: Client, pool_id: str, beat_ms: int, queues: list[str]) -> None:
    """A pool's registration (home) and its joins of ``queues`` (each queue's copy)."""
    home = cc.keys
    cc.client.zadd(home.pools, {pool_id: beat_ms})
    cc.client.hset(home.pool(pool_id), mapping={"dead_after_ms": 1000, "node": pool_id})
    for q in queues:
        cc.client.zadd(home.of(q).pools, {pool_id: beat_ms})


def fetch(cc: Client, pool_id: str, queue: str, n: int = 1) -> tuple[int, list[str], list[str]]:
    """fetch.lua on the queue's copy: (status, tags fetched, queues reported blocked)."""
    k = cc.keys.of(queue)
    status, jobs, _empties, blocked, _waits = cc.scripts(
        "fetch", k.fetch(pool_id, [queue] * n, cc.settings.priority_steps),
        [pool_id, "1" * n, *([queue] * n)])
    return int(status), [bytes_to_str(j[1]) for j in jobs], [bytes_to_str(b) for b in blocked]


def redis_ms(cc: Client) -> int:
    return int(cc.server_time() * 1000)


def test_known_queues_and_copies_on_one_node_and_a_cluster(cc: Client,
                                                          cluster: ClusterGroup) -> None:
    one = Keys("c2_one")
    assert copies(None, one) == [one]  # one node: the one copy, without a round trip
    queues = spread_queues(cluster, cc.keys)
    cc.client.sadd(cc.keys.queues, *queues[:4])
    cc.client.hset(cc.keys.weights, mapping={q: 2 for q in queues[3:]})
    assert known_queues(cc.client, cc.keys) == queues
    assert copies(cc.client, cc.keys) == [cc.keys, *(cc.keys.of(q) for q in queues)]


def test_reaper_returns_a_dead_pools_jobs_from_every_copy(cc: Client,
                                                          cluster: ClusterGroup) -> None:
    queues = spread_queues(cluster, cc.keys)
    for q in queues:
        for j in range(PER_QUEUE):
            enqueue(cc, q, f"{q}-{j}")
    now = redis_ms(cc)
    pool = "host:1:dead"
    register(cc, pool, now, queues)
    fetched = {q: fetch(cc, pool, q, 2)[1] for q in queues}
    assert all(len(tags) == 2 for tags in fetched.values())
    # An orphan: a pool that owns jobs of one queue but has no registration.
    ghost = "host:2:ghost"
    cc.client.zadd(cc.keys.of(queues[0]).pools, {ghost: now})
    assert fetch(cc, ghost, queues[0])[1] == [f"{queues[0]}-2"]
    cc.client.zadd(cc.keys.pools, {pool: now - 60_000})  # its heartbeat stopped a minute ago
    cc.client.srem(cc.keys.ready, *queues)

    reaper = Reaper(cc.client, cc.settings)
    assert set(reaper.stale(redis_ms(cc))) == {pool, ghost}
    assert reaper.stale(redis_ms(cc))[ghost] is None
    result = reaper.reap()
    assert sorted(result.dead_pools) == sorted([pool, ghost])
    assert sorted(result.requeued) == sorted([*(t for ts in fetched.values() for t in ts),
                                              f"{queues[0]}-2"])
    for q in queues:
        k = cc.keys.of(q)
        # Back at the front, the first delivered first fetched again (fetch pops the right).
        order = [json.loads(raw)["properties"]["delivery_tag"]
                 for raw in reversed(cc.client.lrange(k.queue(q), 0, -1))]
        if q == queues[0]:  # two pools' jobs: each pool's returned in delivery order
            assert order.index(f"{q}-0") < order.index(f"{q}-1") and len(order) == 3
        else:
            assert order == [f"{q}-0", f"{q}-1", f"{q}-2"]
        assert not cc.client.exists(k.inflight(pool), k.inflight(ghost))
        assert cc.client.zscore(k.pools, pool) is None
        assert not cc.client.smembers(k.inflight_pools)
        assert int(cc.client.hget(k.redelivery, f"{q}-0")) == 1
    assert {bytes_to_str(q) for q in cc.client.smembers(cc.keys.ready)} == set(queues)
    assert cc.client.zscore(cc.keys.pools, pool) is None
    # The pool was only slow: it registers again, but its next fetch of a queue it joined
    # before is refused (it learns its jobs there were recovered, and joins again).
    cc.client.zadd(cc.keys.pools, {pool: redis_ms(cc)})
    assert fetch(cc, pool, queues[1]) == (0, [], [])
    assert cc.client.llen(cc.keys.of(queues[1]).queue(queues[1])) == PER_QUEUE
    assert cc.state.totals() == {"processed": 0, "failed": 0, "retried": 0}


def test_leading_requeuer_promotes_scheduled_and_retry_jobs_of_every_copy(
        cc: Client, cluster: ClusterGroup) -> None:
    queues = spread_queues(cluster, cc.keys)
    for q in queues:
        k = cc.keys.of(q)
        for tag, retries in ((f"{q}-s", 0), (f"{q}-r", 1)):
            cc.scripts("schedule", *schedule_args(k, q, message(tag, q, retries), 1,
                                                  index_ttl_ms=60_000))
        cc.client.sadd(cc.keys.queues, q)
    later = queues[2]
    cc.scripts("schedule", *schedule_args(cc.keys.of(later), later,
                                          message("later", later), 60_000))
    time.sleep(0.01)
    assert cc.counts() == {"scheduled": 7, "retry": 6, "dead": 0}
    # The job index entry is in the queue's copy; the status finds it there.
    assert cc.job(f"id-{queues[4]}-r", deep=False)["state"] == "retrying"
    assert [j["id"] for j in cc.retries()["items"]] == sorted(f"{q}-r" for q in queues)

    requeuer = Requeuer(cc.client, cc.settings)
    result = requeuer.promote()
    assert result.leader and result.moved == 12
    assert result.next_due_in is not None and 50 < result.next_due_in <= 60
    for q in queues:
        k = cc.keys.of(q)
        assert sorted(json.loads(raw)["properties"]["delivery_tag"]
                      for raw in cc.client.lrange(k.queue(q), 0, -1)) == [f"{q}-r", f"{q}-s"]
        assert bytes_to_str(cc.client.get(k.requeuer_lease)) == requeuer.id
    assert {bytes_to_str(q) for q in cc.client.smembers(cc.keys.ready)} == set(queues)
    assert cc.counts() == {"scheduled": 1, "retry": 0, "dead": 0}
    assert cc.job(f"id-{queues[4]}-r", deep=False)["state"] == "queued"
    # Run it now: the client finds the job in its queue's copy; the next pass moves it.
    assert cc.run_scheduled_now("later")
    assert requeuer.promote().moved == 1
    assert cc.counts()["scheduled"] == 0


def test_dead_set_merged_over_copies(cc: Client, cluster: ClusterGroup,
                                     cluster_url: str) -> None:
    queues = spread_queues(cluster, cc.keys)
    pool = "host:3:alive"
    register(cc, pool, redis_ms(cc), queues)
    order = []
    for n, q in enumerate(queues):
        enqueue(cc, q, f"{q}-0")
        assert fetch(cc, pool, q)[1] == [f"{q}-0"]
        assert dead_letter(cc.client, cc.settings, pool, f"{q}-0", reason="failed",
                           error=f"ValueError: boom {n}" if n % 2 else f"KeyError: {n}",
                           keys=cc.keys.of(q))
        order.append(f"{q}-0")
        time.sleep(0.003)  # distinct failed_at, so the merged order is the order of death
    newest = list(reversed(order))
    assert cc.counts()["dead"] == 6
    page = cc.dead(limit=4)
    assert page["total"] == 6 and [j["id"] for j in page["items"]] == newest[:4]
    assert [j["id"] for j in cc.dead(offset=4, limit=4)["items"]] == newest[4:]
    assert [j["id"] for j in cc.dead(name=queues[3])["items"]] == [f"{queues[3]}-0"]
    assert cc.dead_job(order[2])["queue"] == queues[2]  # type: ignore[index]

    # Search, page by page with the cursor: the matches of every copy in set order.
    seen, cursor = [], None
    while True:
        found = cc.search("dead", Filters(error="ValueError"), cursor, limit=2)
        seen += [j["id"] for j in found["items"]]
        cursor = found["cursor"]
        if cursor is None:
            break
    assert seen == [i for i in newest if int(cc.dead_job(i)["error"][-1]) % 2]  # type: ignore[index]
    assert cc.count_matching("dead", Filters(error="KeyError")) == 3
    out = celery_cli("-A", "tests.apps.proj", "ext", "dead", "ls", "--json", broker_url=cluster_url,
                     env={"CELERY_EXT_CLUSTER": "1",
                          "CELERY_EXT_NAMESPACE": cc.settings.namespace})
    assert out.returncode == 0, out.stderr
    assert [j["id"] for j in json.loads(out.stdout)["items"]] == newest

    with TestClient(create_app(cc, sample_interval=60)) as tc:
        listed = tc.get("/api/dead", params={"limit": 10}).json()
        assert [j["id"] for j in listed["items"]] == newest
        hits = tc.get("/api/dead/search", params={"error": "KeyError"}).json()
        assert sorted(j["id"] for j in hits["items"]) == sorted(
            i for i in order if "KeyError" in cc.dead_job(i)["error"])  # type: ignore[index]
        token = tc.get("/api/csrf").json()["csrf_token"]
        done = tc.post("/api/dead/retry", json={"ids": [order[0]]},
                       headers={"X-CSRF-Token": token}).json()
        assert done["retried"] == [order[0]]
    k0 = cc.keys.of(queues[0])
    assert cc.client.llen(k0.queue(queues[0])) == 1
    assert queues[0].encode() in cc.client.smembers(cc.keys.ready)
    assert cc.retry_matching("dead", Filters(error="ValueError")) == 3
    assert cc.delete_all_dead() == 2
    assert cc.counts()["dead"] == 0
    assert sum(cc.client.llen(cc.keys.of(q).queue(q)) for q in queues) == 4


def test_pause_and_limits_live_in_the_queues_copy(cc: Client, cluster: ClusterGroup) -> None:
    queues = spread_queues(cluster, cc.keys)
    for q in queues:
        for j in range(PER_QUEUE):
            enqueue(cc, q, f"{q}-{j}")
    pool = "host:4:p"
    register(cc, pool, redis_ms(cc), queues)
    paused, limited = queues[1], queues[4]
    assert cc.pause(paused)
    assert cc.client.sismember(cc.keys.of(paused).paused, paused)
    assert fetch(cc, pool, paused) == (1, [], [paused])
    cc.set_max_concurrency(limited, 1)
    assert bytes_to_str(cc.client.hget(cc.keys.of(limited).limits, limited)) == "1"
    status, tags, blocked = fetch(cc, pool, limited, 2)
    assert (status, tags, blocked) == (1, [f"{limited}-0"], [limited])
    assert cc.paused() == [paused] and cc.limits() == {limited: 1}
    assert cc.set_rate_limit(queues[0], "10/m") == "10/m"
    assert cc.rate_limits() == {queues[0]: "10/m"}

    rows = {q["name"]: q for q in cc.job_queues()}
    assert sorted(rows) == queues
    assert rows[paused]["paused"] and rows[paused]["size"] == PER_QUEUE
    assert rows[limited]["max_concurrency"] == 1 and rows[limited]["in_flight"] == 1
    assert rows[limited]["size"] == PER_QUEUE - 1
    assert rows[queues[0]]["rate_limit"] == "10/m"
    assert cc.resume(paused)
    assert fetch(cc, pool, paused)[1] == [f"{paused}-0"]
    # A pool starting writes the limits of its task options, each in its queue's copy.
    assert write_limits(cc.client, cc.keys, {queues[2]: 3}, queues) == [queues[2], limited]
    assert cc.limits() == {queues[2]: 3}
    assert cc.client.hget(cc.keys.of(queues[2]).limits, queues[2]) == b"3"


def test_views_cli_and_metrics_read_every_copy(cc: Client, cluster: ClusterGroup,
                                               cluster_url: str) -> None:
    queues = spread_queues(cluster, cc.keys)
    for n, q in enumerate(queues):
        for j in range(n + 1):
            enqueue(cc, q, f"{q}-{j}")
        cc.client.hincrby(cc.keys.of(q).stats, "processed", 10 * (n + 1))
        cc.client.hincrby(cc.keys.of(q).stats, f"processed:{q}", 10 * (n + 1))
    sizes = {q: n + 1 for n, q in enumerate(queues)}
    with TestClient(create_app(cc, sample_interval=60)) as tc:
        page = tc.get("/api/queues").json()
    assert {q["name"]: q["size"] for q in page["items"]} == sizes
    assert cc.totals()["processed"] == 210

    env = {"CELERY_EXT_CLUSTER": "1", "CELERY_EXT_NAMESPACE": cc.settings.namespace}
    out = celery_cli("-A", "tests.apps.proj", "ext", "queues", "--json", broker_url=cluster_url,
                     env=env)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    items = rows["items"] if isinstance(rows, dict) else rows
    assert {q["name"]: q["size"] for q in items} == sizes

    text = generate_latest(registry_for(cc)).decode()
    for q, n in sizes.items():
        assert f'celery_ext_queue_depth{{queue="{q}"}} {float(n)}' in text
        assert f'celery_ext_jobs_processed_total{{queue="{q}"}} {float(10 * n)}' in text


class _LeaderDies(Exception):
    """Raised where a leader in these tests stops between two of its round trips."""


def test_periodic_run_on_a_cluster_is_enqueued_once_per_due_time(cc: Client) -> None:
    """The entry's check (home copy) and the push (the queue's copy) are two round trips
    on a cluster. With the publish marker off (``publish_idempotency_ttl`` 0: a 1 ms
    marker), a leader that dies after its push and before moving ``next_due`` on, and
    a leader stalled between its check and its push while the next leader runs the due
    time, still leave one job per due time: the queue's copy keeps a run record of the
    entry that ``enqueue.lua`` checks."""
    queue, name = "tasks.tick", "tick"
    copy, home = cc.keys.of(queue), cc.keys
    cc.client.hset(home.periodic_entry(name), mapping={"next_due": 1000})

    def run(due: int) -> PeriodicRun:
        return PeriodicRun(name, run_id(home.namespace, name, due), due, due, due + 1000)

    def write(one: PeriodicRun, tag: str, client: Any = None, scripts: Any = None) -> int:
        push = ("enqueue", [copy.queue(queue), copy.ready, copy.queues, copy.job_index,
                            copy.job_index_done, copy.published(run_marker(one))],
                [json.dumps(message(tag, queue)), queue, home.wake_channel, 0, 0, 1])
        return write_run_apart(scripts or cc.scripts, client or cc.client, home, queue, push,
                               one)

    def queued() -> list[str]:
        return [json.loads(raw)["properties"]["delivery_tag"]
                for raw in reversed(cc.client.lrange(copy.queue(queue), 0, -1))]

    assert write(run(1000), "a") == 1
    assert write(run(1000), "a") == 0  # a slow second leader: the due time has moved on

    # A leader that dies after its push of due time 2000, before moving next_due on.
    def dies_after_the_push(script: str, keys: list[str], args: list[Any]) -> Any:
        if script == "periodic_run":
            raise _LeaderDies
        return cc.scripts(script, keys, args)

    with pytest.raises(_LeaderDies):
        write(run(2000), "b", scripts=dies_after_the_push)
    time.sleep(0.01)  # its publish marker (1 ms) is gone
    assert write(run(2000), "b2") == 1  # the next leader records the run, pushes nothing
    assert queued() == ["a", "b"]

    # A leader that checks due time 3000, then stalls while the next leader runs 3000 and
    # 4000; it pushes after that.
    class Stalls:
        def __getattr__(self, attr: str) -> Any:
            return getattr(cc.client, attr)

        def hmget(self, *args: Any) -> Any:
            reply = cc.client.hmget(*args)
            assert write(run(3000), "c") == 1 and write(run(4000), "d") == 1
            time.sleep(0.01)
            return reply

    assert write(run(3000), "c-stale", client=Stalls()) == 0
    assert queued() == ["a", "b", "c", "d"]
    state = {bytes_to_str(f): bytes_to_str(v)
             for f, v in cc.client.hgetall(home.periodic_entry(name)).items()}
    assert (state["next_due"], state["runs"], state["last_due"]) == ("5000", "4", "4000")
    assert state["last_job_id"] == run(4000).job_id
    assert queue.encode() in cc.client.smembers(home.queues)


def test_stop_requests_find_jobs_in_flight_in_their_queues_copy(cc: Client,
                                                                cluster: ClusterGroup) -> None:
    """A job's index entry lives in its queue's copy, the stop requests in the home
    copy: a request finds the job in flight on whichever master, and its checkin (a
    home-copy script) answers "stop"; a job in flight nowhere is refused. In flight is
    either entry form: the queued entry the fetch leaves, whose tag a pool's in-flight
    record in the copy holds, or the inflight entry of the previous version."""
    queues = spread_queues(cluster, cc.keys)
    for q in queues:
        k = cc.keys.of(q)
        cc.client.hset(k.job_index, f"id-{q}", f"inflight\n1\n{q}\n{q}-0\nhost:5:p")
        cc.client.hset(k.job_index, f"qid-{q}", f"queued\n1\n{q}\n0\n{q}-1")
        cc.client.hset(k.inflight("host:6:p"), f"{q}-1", f"{q}\n{{}}")
        cc.client.sadd(k.inflight_pools, "host:6:p")
        cc.client.hset(k.job_index, f"nid-{q}", f"queued\n1\n{q}\n0\n{q}-2")  # held nowhere
        cc.client.sadd(cc.keys.queues, q)  # the home registry, as every enqueue writes it
    for q in queues:
        st = cc.job(f"qid-{q}")
        assert (st["state"], st["pool"], st["queue"]) == ("reserved", "host:6:p", q), st
    assert all(cc.request_stop(f"id-{q}") for q in queues)
    assert all(cc.request_stop(f"qid-{q}") for q in queues)
    assert not any(cc.request_stop(f"nid-{q}") for q in queues)
    assert not cc.request_stop("id-nobody")
    assert cc.client.zcard(cc.keys.stop_requests) == 2 * len(queues)
    k = cc.keys
    stop, _state, _now = cc.scripts("checkin", [k.checkins, k.stop_requests, k.pool("host:5:p")],
                                    [f"id-{queues[0]}", "{}"])
    assert stop == 1
