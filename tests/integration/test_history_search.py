"""The history in Redis and the search in the sets, over HTTP (httpx against ``celery
ext web``, a real server) and the CLI, with a real worker writing the history."""

from __future__ import annotations

import base64
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from kombu.utils.encoding import bytes_to_str

with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from celery_ext.admin.search import SCAN_CHUNK, Filters, SetSearch, base64_patterns
from celery_ext.admin.web import create_app
from celery_ext.client import Client
from celery_ext.config import Settings
from celery_ext.store.history import HistoryWriter, bucket_bounds, bucket_of, percentile
from celery_ext.store.keys import Keys
from tests.apps import proj_web
from tests.helpers import celery_cli
from tests.webutil import (
    env_for,
    fill_dead,
    run_cli,
    start_web,
    stop_all,
    task_payload,
    wait_for,
)
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
#: Queue-size samples this often in the test workers (default: once a minute).
FAST_SAMPLES = {"CELERY_EXT_HISTORY_SAMPLE_INTERVAL": "0.5"}


@pytest.fixture
def web(broker_url: str, redis_client: redis.Redis, tmp_path: Path) -> Iterator[httpx.Client]:
    proc, base = start_web(broker_url, tmp_path)
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            yield http
    finally:
        stop_all([proc])


def csrf(http: httpx.Client) -> dict[str, str]:
    return {"X-CSRF-Token": http.get("/api/csrf").json()["csrf_token"]}


def test_base64_patterns_find_the_text_at_every_alignment() -> None:
    for prefix in ("", "x", "xy", "xyz"):
        body = base64.b64encode(f'[["{prefix}order-42", 1], {{}}]'.encode()).decode()
        patterns = base64_patterns("order-42")
        assert any(p and p in body for p in patterns[0::2]), prefix


def test_percentiles_fall_within_the_bucket_of_the_true_value() -> None:
    runtimes = [0.0005] + [0.003] * 50 + [0.2] * 44 + [5.0] * 5  # 100 runs
    buckets: dict[int, int] = {}
    for r in runtimes:
        buckets[bucket_of(r)] = buckets.get(bucket_of(r), 0) + 1
    for q, true in ((0.5, 0.003), (0.95, 0.2), (0.99, 5.0)):
        value = percentile(buckets, q)
        low, high = bucket_bounds(bucket_of(true))
        assert value is not None and low <= value <= high, (q, value)
    assert percentile({}, 0.5) is None


def test_a_host_clock_an_hour_off_writes_the_redis_minute(redis_client: redis.Redis) -> None:
    writer = HistoryWriter(redis_client, Settings())
    writer.offset = 3600.0  # this host believes it is an hour later
    writer.add("tasks.x", "processed", 0.01)
    writer.flush()
    seconds, micros = redis_client.time()
    minute = (seconds * 1000 + micros // 1000) // 60000
    written = [redis_client.hget(K.history_minute(m), "n:tasks.x") for m in (minute - 1, minute)]
    assert b"1 0 0 4:1" in written  # 10 ms: bucket 4, [8, 16) ms
    assert abs(writer.offset) < 60


def test_history_from_the_workers(web: httpx.Client, broker_url: str, tmp_path: Path,
                                  worker_factory: Callable[..., WorkerProcess]) -> None:
    proj_web.configure(broker_url)
    worker_factory(proj_web.__name__, concurrency=2, env=env_for(broker_url, **FAST_SAMPLES)
                   ).start()
    results = [proj_web.echo.delay(i) for i in range(6)]
    proj_web.fragile.delay("k-history-never", "x")
    for r in results:
        r.get(timeout=20)

    def counted() -> Any:
        h = web.get("/api/history", params={"window": "1h"}).json()
        return h if sum(h["processed"]) >= 6 and sum(h["failed"]) >= 1 else None
    h = wait_for(counted, what="the job counts in the history")
    assert h["resolution"] == 60 and len(h["t"]) == 60
    assert any(p is not None and 0 <= p < 5 for p in h["p50"])
    sampled = wait_for(lambda: (lambda d: d if any(v is not None for v in d["dead"]) else None)(
        web.get("/api/history", params={"window": "1h"}).json()), what="a queue-size sample")
    assert max(v for v in sampled["dead"] if v is not None) >= 1

    runtimes = web.get("/api/history/runtimes", params={"window": "24h"}).json()["items"]
    rows = {r["name"]: r for r in runtimes}
    assert rows["tests.apps.proj_web.echo"]["processed"] == 6
    assert rows["tests.apps.proj_web.fragile"]["failed"] == 1
    assert rows["tests.apps.proj_web.echo"]["p50"] is not None
    assert rows["tests.apps.proj_web.echo"]["p50"] <= rows["tests.apps.proj_web.echo"]["p99"]

    long = web.get("/api/history", params={"window": "30d"}).json()
    assert long["resolution"] == 3600 and sum(long["processed"]) >= 6
    bad = web.get("/api/history", params={"window": "2y"})
    assert bad.status_code == 400 and "1h" in bad.json()["error"]


def _jobs() -> list[tuple[str, str, str, list[Any]]]:
    """600 dead jobs: 3 names x 2 error types; 7 of shop.charge/KeyError mention "vip"."""
    jobs = []
    for i in range(600):
        name = ("shop.charge", "shop.refund", "shop.mail")[i % 3]
        exc = "KeyError" if i % 2 else "TimeoutError"
        who = "vip" if i % 6 in (0, 3) and i < 42 else "guest"
        jobs.append((f"d{i:04d}", name, exc, [f"{who}-customer-{i}", {"total": i}]))
    return jobs


def test_search_filters_pages_and_bulk_actions(web: httpx.Client, redis_client: redis.Redis,
                                               broker_url: str) -> None:
    fill_dead(redis_client, _jobs())
    assert redis_client.zcard(K.dead) == 600

    def search(**params: Any) -> Any:
        r = web.get("/api/dead/search", params=params)
        assert r.status_code == 200, r.text
        return r.json()

    assert search(name="shop.charge", count=1)["total"] == 200
    assert search(error="KeyError", count=1)["total"] == 300
    assert search(error="-customer-123'", count=1)["total"] == 1  # a part of the error text
    vip = search(name="shop.charge", error="KeyError", text="vip-customer", count=1)
    assert vip["total"] == 7 and vip["cursor"] is None
    assert {j["args"][0] for j in vip["items"]} == {f"vip-customer-{i}" for i in range(3, 42, 6)}
    assert all("payload" not in j for j in vip["items"])

    # Cursor pages: every match once, newest first, however the pages fall.
    seen: list[str] = []
    cursor = None
    while True:
        page = search(error="TimeoutError", limit=7, **({"cursor": cursor} if cursor else {}))
        seen += [j["id"] for j in page["items"]]
        cursor = page["cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == 300
    scores = [redis_client.zscore(K.dead, i) for i in seen]
    assert scores == sorted(scores, reverse=True)

    # A time range: the jobs dead at/after the 500th one's time.
    t500 = redis_client.zscore(K.dead, "d0500")
    # ``since`` is read to the millisecond, and a dead job's score orders the jobs dead in
    # one millisecond below the next (store/lua/include/dead_set.lua): those count as "at".
    later = search(since=t500 / 1000, count=1)["total"]
    assert later == sum(1 for i in range(600)
                        if redis_client.zscore(K.dead, f"d{i:04d}") >= int(t500))
    assert search(until=t500 / 1000 - 1e6, count=1)["total"] == 0

    # Bulk: retry the 7, delete the shop.mail ones; the rest stays.
    headers = csrf(web)
    r = web.post("/api/dead/search/retry", headers=headers,
                 json={"name": "shop.charge", "error": "KeyError", "text": "vip-customer"})
    assert r.status_code == 200 and r.json() == {"count": 7}
    assert redis_client.llen(K.queue("shop.charge")) == 7
    assert redis_client.zcard(K.dead) == 593
    assert web.post("/api/dead/search/delete", headers=headers,
                    json={"name": "shop.mail"}).json() == {"count": 200}
    assert redis_client.zcard(K.dead) == 393
    assert search(name="shop.mail", count=1)["total"] == 0

    # Refused: no filter on a bulk action, no CSRF token, bad cursor, bad time, long text.
    assert web.post("/api/dead/search/delete", headers=headers, json={}).status_code == 400
    assert web.post("/api/dead/search/retry", json={"name": "shop.charge"}).status_code == 403
    assert web.get("/api/dead/search", params={"cursor": "x:y"}).status_code == 400
    assert web.get("/api/dead/search", params={"since": "yesterday"}).status_code == 400
    assert web.get("/api/retry/search", params={"text": "x" * 500}).status_code == 400
    assert redis_client.zcard(K.dead) == 393

    # The CLI filters the same way.
    out = run_cli(broker_url, "dead", "ls", "--name", "shop.refund", "--error", "KeyError",
                  "--text", "guest-customer-61", "--json")
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert [j["id"] for j in listed["items"]] == ["d0061"]


def test_search_in_the_scheduled_and_retry_sets(redis_client: redis.Redis, broker_url: str
                                                ) -> None:
    proj_web.configure(broker_url)
    client = Client.from_app(proj_web.app)
    try:
        for i in range(30):
            proj_web.echo.apply_async((f"later-{i}",), countdown=600 + i)
        wait_for(lambda: client.counts()["scheduled"] == 30, what="30 scheduled jobs")
        page = client.search("scheduled", Filters(text="later-2"), limit=100)
        assert sorted(j["args"][0] for j in page["items"]) == sorted(
            f"later-{i}" for i in range(30) if f"later-{i}".startswith("later-2"))
        assert client.count_matching("scheduled", Filters(name="tests.apps.proj_web.echo")) == 30
        assert client.count_matching("scheduled", Filters(name="other")) == 0
        # "Run now" for the matches: they are due at once; the others keep their time.
        assert client.retry_matching("scheduled", Filters(text="later-1")) == 11
        assert len(redis_client.zrangebyscore(K.scheduled, 0, 0)) == 11  # no requeuer runs
        assert client.delete_matching("scheduled", Filters(text="later-2")) == 11
        assert client.counts()["scheduled"] == 19
    finally:
        client.client.close()


#: Time filters that are numbers to ``float`` but no time a set's score can be.
BAD_TIMES = [("since", "inf"), ("until", "inf"), ("since", "-inf"), ("until", "nan"),
             ("since", "1e306"), ("until", float("inf"))]


def test_bad_search_filters_are_a_400_naming_the_filter(redis_client: redis.Redis,
                                                       broker_url: str) -> None:
    with TestClient(create_app(Client(redis_client), sample_interval=60)) as api:
        headers = {"X-CSRF-Token": api.get("/api/csrf").json()["csrf_token"]}
        for kind in ("dead", "scheduled"):
            for name, value in BAD_TIMES:
                if isinstance(value, str):
                    r = api.get(f"/api/{kind}/search", params={name: value})
                    assert r.status_code == 400, (kind, name, value, r.text)
                    assert repr(name) in r.json()["error"], r.text
                for action in ("retry", "delete"):
                    r = api.post(f"/api/{kind}/search/{action}",  # Infinity for a float
                                 content=json.dumps({name: value}),
                                 headers={**headers, "Content-Type": "application/json"})
                    assert r.status_code == 400, (kind, action, name, value, r.text)
                    assert repr(name) in r.json()["error"], r.text
            for cursor in ("nan:0", "-nan:3", "1_000:0", " 5:0", "x:0", "5:-1"):
                r = api.get(f"/api/{kind}/search", params={"name": "x", "cursor": cursor})
                assert r.status_code == 400, (kind, cursor, r.text)
                assert "cursor" in r.json()["error"], r.text
        # A cursor the server gave goes on as before.
        assert api.get("/api/dead/search", params={"cursor": "17:0"}).status_code == 200
    for args in (["dead", "ls", "--since", "inf"], ["dead", "rm", "--all", "--until", "1e306"],
                 ["dead", "ls", "--cursor", "nan:0"]):
        out = celery_cli("-A", "tests.apps.proj", "ext", *args, broker_url=broker_url)
        assert out.returncode == 2, (args, out.returncode, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
        assert ("since" if "--since" in args else "until" if "--until" in args
                else "cursor") in out.stderr, out.stderr


#: One score for every job of the bulk-action test: a burst within one millisecond.
BURST_MS = 1_700_000_000_000


def _burst(redis_client: redis.Redis, kind: str, n: int) -> None:
    """``n`` jobs j0000... in the ``kind`` set at one score, every other one named
    ``a.match``: dead-lettered by the ``dead`` script, or scheduled records as
    ``schedule.lua`` writes them."""
    names = ["a.match" if i % 2 == 0 else "a.other" for i in range(n)]
    if kind == "dead":
        fill_dead(redis_client, [(f"j{i:04d}", names[i], "KeyError", [f"job-{i}"])
                                 for i in range(n)])
    else:
        redis_client.hset(K.scheduled_jobs, mapping={
            f"j{i:04d}": f'{{"name": "{names[i]}"}}\n{names[i]}\n'
                         f'{task_payload(f"j{i:04d}", names[i], [i])}' for i in range(n)})
    redis_client.zadd(getattr(K, kind), {f"j{i:04d}": BURST_MS for i in range(n)})


@pytest.mark.parametrize("kind", ["dead", "scheduled"])
def test_bulk_action_misses_no_match_when_others_remove_entries_at_its_cursor(
        redis_client: redis.Redis, kind: str) -> None:
    """A bulk action walks a set chunk by chunk; while it acts on one chunk, someone
    else removes jobs it has already passed (a person deleting them, the requeuer
    promoting them), all at the score its cursor stands on (a burst within one
    millisecond). Every match is still acted on: none is skipped because the entries
    before the cursor became fewer. The dead set is walked newest first (members of
    one score in reverse byte order), the scheduled set oldest first."""
    n = 2 * SCAN_CHUNK + 200
    _burst(redis_client, kind, n)
    zset = getattr(K, kind)
    client = Client(redis_client)
    first_chunk = [bytes_to_str(i) for i in redis_client.zrange(zset, 0, SCAN_CHUNK - 1,
                                                                  desc=kind == "dead")]
    others = [i for i in first_chunk if int(i[1:]) % 2][:100]  # passed, not matching
    calls = 0

    def act_and_meanwhile_others_remove(ids: list[str]) -> set[str]:
        nonlocal calls
        calls += 1
        if kind == "dead":
            done = {i for i in ids if client.delete_dead(i)}
        else:  # "run now": due at once, out of the cursor's score
            done = {i for i in ids if client.run_scheduled_now(i)}
        if calls == 1:
            assert redis_client.zrem(zset, *others) == len(others)
        return done

    search = SetSearch(redis_client, client.scripts, K, kind)
    acted = search.act(Filters(name="a.match"), act_and_meanwhile_others_remove)
    assert acted == n // 2
    left = {bytes_to_str(i) for i in redis_client.zrangebyscore(zset, BURST_MS, BURST_MS)}
    assert left == {f"j{i:04d}" for i in range(1, n, 2)} - set(others)
