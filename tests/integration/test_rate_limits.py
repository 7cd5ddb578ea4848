"""Cluster-wide rate limits (issue 14): a task's ``rate_limit`` holds across all pools.

The fetch script itself against a real server (a refused fetch, its wait, the stats
counter), the parsing and the task-to-queue rules on their own, then real ``celery
worker`` pools: three ``-P threads -c 4`` pools under ``install(app)`` hold 20/s
together while another queue runs at full speed, and a drop-in pool holds the limit
without Celery's per-process bucket holding prefetched jobs on top.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ext.client import Client
from celery_ext.config import DEFAULT_PRIORITY_STEPS
from celery_ext.options.rate_limits import format_rate, interval_us, job_rate_limits
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from tests.apps import proj
from tests.helpers import Factory, Mode, celery_cli, push, start_workers, wait_for

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")


def fetch(client: redis.Redis, *queues: str) -> tuple[list[Any], list[str], dict[str, int]]:
    """One no-ack fetch of ``queues`` (candidates, repeats allowed): the jobs, the
    blocked queues and the waits (µs) of the reply."""
    keys = K.fetch("-", queues, DEFAULT_PRIORITY_STEPS)
    _, jobs, _, blocked, waits = Scripts(client)("fetch", keys, ["-", "0" * len(queues), *queues])
    return (list(jobs), [b.decode() for b in blocked],
            {q.decode(): int(us) for q, us in waits})


def max_in_window(starts: list[float], window: float) -> int:
    """The most start times in any half-open window of ``window`` seconds."""
    starts = sorted(starts)
    best, j = 0, 0
    for i, t in enumerate(starts):
        while starts[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def starts(rec: redis.Redis, key: str) -> list[float]:
    return [float(v) for v in rec.lrange(f"runs:{key}", 0, -1)]


# -- pure parts -------------------------------------------------------------------------
def test_rates_parse_and_format_as_celery_writes_them() -> None:
    assert interval_us("20/s") == 50_000
    assert interval_us("10/m") == 6_000_000
    assert interval_us("5/h") == 720_000_000
    assert interval_us(100) == 10_000
    assert interval_us(None) is None and interval_us("") is None and interval_us(0) is None
    for value in ("20/s", "10/m", "5/h", "3/s", "7/m", "1/h"):
        assert format_rate(interval_us(value) or 0) == value
    for bad in ("fast", "20/d", "-5/s"):
        with pytest.raises(ValueError, match="is not a rate limit"):
            interval_us(bad)


def test_a_limit_holds_cluster_wide_only_on_a_queue_of_its_own() -> None:
    """A queue whose tasks all share one limit is limited in fetch; a limited task on a
    queue shared with others keeps Celery's per-process bucket."""
    app = Celery("rates", set_as_current=False)
    app.conf.task_routes = {"rates.routed": {"queue": "routed_q"}}

    @app.task(name="rates.own", rate_limit="5/s", queue="own_q", shared=False)
    def own() -> None: ...

    @app.task(name="rates.routed", rate_limit="10/m", shared=False)
    def routed() -> None: ...

    @app.task(name="rates.shared", rate_limit="2/s", shared=False)
    def shared() -> None: ...

    @app.task(name="rates.other", shared=False)
    def other() -> None: ...

    limits = job_rate_limits(app)
    assert limits.queues == {"own_q": 200_000, "routed_q": 6_000_000}
    assert limits.tasks == {"rates.own", "rates.routed"}
    assert limits.local == {"rates.shared": "celery"}  # shares "celery" with rates.other

    @app.task(name="rates.bad", rate_limit="often", shared=False)  # not in later apps
    def bad() -> None: ...

    with pytest.raises(ValueError, match=r"task 'rates\.bad' has rate_limit='often'"):
        job_rate_limits(app)


# -- the fetch script -------------------------------------------------------------------
def test_fetch_refuses_a_job_before_it_is_due_and_says_when(redis_client: redis.Redis) -> None:
    for i in range(3):
        push(redis_client, "q", json.dumps({"n": i}))
    push(redis_client, "other", json.dumps({"n": 9}))
    Client(redis_client).set_rate_limit("q", "1/s")
    # Three candidates of the limited queue and one of another: one job of each.
    jobs, blocked, waits = fetch(redis_client, "q", "q", "other", "q")
    assert [j[0] for j in jobs] == [b"q", b"other"]
    assert blocked == ["q"] and 900_000 <= waits["q"] <= 1_000_000
    assert redis_client.hget(K.stats, "rate_limited") is None  # no job was refused yet
    # Asked again before its time: nothing, the wait left, one refusal counted.
    jobs, blocked, waits = fetch(redis_client, "q")
    assert jobs == [] and blocked == ["q"] and 0 < waits["q"] <= 1_000_000
    assert redis_client.hmget(K.stats, ["rate_limited", "rate_limited:q"]) == [b"1", b"1"]
    # A new limit starts afresh: the next job is due at once.
    assert Client(redis_client).set_rate_limit("q", "600/m") == "10/s"
    jobs, blocked, waits = fetch(redis_client, "q")
    assert len(jobs) == 1 and blocked == ["q"] and 90_000 <= waits["q"] <= 100_000
    # No limit: the remaining jobs come at once.
    assert Client(redis_client).set_rate_limit("q", None) is None
    redis_client.rpush(K.queue("q"), json.dumps({"n": 3}))
    jobs, blocked, waits = fetch(redis_client, "q", "q")
    assert len(jobs) == 2 and blocked == [] and waits == {}


# -- real pools -------------------------------------------------------------------------
@pytest.fixture
def proj_rate(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_rate

    return proj_rate


def test_three_pools_hold_the_rate_together_and_other_queues_run_freely(
        proj_rate: Any, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    """300 jobs at 20/s over 3 pools x 4 threads: at most 41 start in any 2 s (one
    job per 50 ms, plus the first); 150 jobs of an unlimited queue sent at the same
    time all run before half the limited ones have; the pools do not poll the limited
    queue (refused fetches stay under three per job)."""
    start_workers(worker_factory, 3, app="tests.apps.proj_rate", pool="threads", concurrency=4)
    client = Client(redis_client)
    assert client.rate_limits() == {"rated": "20/s"}
    rec.delete("runs:r", "runs:u")
    limited, unlimited = 300, 150  # 15 s of the limit: its 2 s windows seven times over
    for _ in range(limited):
        proj_rate.rated.delay("r")
    for _ in range(unlimited):
        proj_rate.unrated.delay("u")
    wait_for(lambda: rec.llen("runs:u") >= unlimited, 60, "the unlimited jobs")
    limited_so_far = rec.llen("runs:r")
    wait_for(lambda: rec.llen("runs:r") >= limited, 90, "the limited jobs", step=0.5)
    r, u = starts(rec, "r"), starts(rec, "u")
    assert len(r) == limited and len(u) == unlimited
    assert limited_so_far < limited // 2, limited_so_far
    assert max(u) < sorted(r)[limited // 2 - 1]
    assert max_in_window(r, 2.0) <= 41, max_in_window(r, 2.0)
    refused = int(redis_client.hget(K.stats, "rate_limited:rated") or 0)
    assert refused <= 3 * limited, refused
    print(f"rated: {(limited - 1) / (max(r) - min(r)):.2f} jobs/s over "
          f"{max(r) - min(r):.1f} s, at most {max_in_window(r, 2.0)} in 2 s, "
          f"{refused} refused fetches; unlimited: {unlimited} in {max(u) - min(u):.2f} s")


@pytest.mark.parametrize(("pool", "concurrency"), [("threads", 4), ("gevent", 50)])
def test_dropin_pool_holds_the_rate_without_holding_jobs(
        pool: str, concurrency: int, broker_url: str, redis_client: redis.Redis,
        rec: redis.Redis, worker_factory: Factory) -> None:
    """Only the URL is ours: the task's limit reaches Redis from the pool. Raised to
    40/s by hand, it holds (at most 21 jobs start in any 0.5 s) and the jobs wait in
    their queue, not in the pool: Celery's own 20/s bucket, were it applied on top,
    would hold up to the pool's whole prefetch (16 for 4 threads) in flight; here a job is in flight
    for the few ms it runs (at most 8 allows for a loaded machine's late acks). Celery's
    ``rate_limit`` remote-control command changes the limit in Redis.

    The rate is reached, not only capped: the 60 jobs take their 1.5 s, not many times it.
    Under gevent Celery runs no event loop for the pool's timers; the poller's wait is
    what ends at a limited queue's next due time."""
    mode = Mode("dropin", broker_url)
    try:
        worker_factory("tests.apps.proj_rate", pool=pool, concurrency=concurrency,
                       queues=["rated", "celery"], env=mode.env(acks_late=True)).start()
        client = Client(redis_client)
        assert client.rate_limits() == {"rated": "20/s"}
        assert client.set_rate_limit("rated", "40/s") == "40/s"
        rec.delete("runs:d")
        in_flight: list[int] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                in_flight.append(int(redis_client.hget(K.running, "rated") or 0))
                done.wait(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            for _ in range(60):
                mode.app.send_task("tests.apps.proj_rate.rated", args=("d",), queue="rated")
            wait_for(lambda: rec.llen("runs:d") >= 60, 30, "the drop-in jobs")
        finally:
            done.set()
            sampler.join()
        assert max_in_window(starts(rec, "d"), 0.5) <= 21
        took = max(starts(rec, "d")) - min(starts(rec, "d"))
        assert took < 3 * 59 / 40 + 1, took  # a pool that missed its wake-ups: 30 s+
        assert max(in_flight) <= 8, max(in_flight)
        out = celery_cli("-A", "tests.apps.proj_rate", "control", "rate_limit",
                         "tests.apps.proj_rate.rated", "5/m", broker_url=broker_url, env=mode.env())
        assert out.returncode == 0, out.stderr
        wait_for(lambda: client.rate_limits() == {"rated": "5/m"}, 10, "the new limit")
    finally:
        mode.close()


def test_cli_sets_shows_and_clears_a_rate_limit(broker_url: str,
                                                redis_client: redis.Redis) -> None:
    args = ("-A", "tests.apps.proj", "ext", "rate-limit")
    out = celery_cli(*args, "reports", "10/m", broker_url=broker_url)
    assert out.returncode == 0 and "reports: rate limit 10/m" in out.stdout, out.stderr
    assert Client(redis_client).rate_limits() == {"reports": "10/m"}
    out = celery_cli(*args, "--json", broker_url=broker_url)
    assert json.loads(out.stdout) == {"reports": "10/m"}
    out = celery_cli(*args, "reports", "often", broker_url=broker_url)
    assert out.returncode == 2 and "is not a rate limit" in out.stderr
    out = celery_cli(*args, "reports", "--clear", broker_url=broker_url)
    assert out.returncode == 0 and "reports: no rate limit" in out.stdout
    assert Client(redis_client).rate_limits() == {}


def test_dashboard_api_sets_and_clears_a_rate_limit(redis_client: redis.Redis) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    from celery_ext.admin.web import create_app

    push(redis_client, "reports", json.dumps({"n": 1}))
    with TestClient(create_app(Client(redis_client), sample_interval=0.2)) as api:
        headers = {"X-CSRF-Token": api.get("/api/csrf").json()["csrf_token"]}

        def post(rate: Any) -> Any:
            return api.post("/api/queues/rate_limit", headers=headers,
                            json={"name": "reports", "rate_limit": rate})

        def shown() -> Any:
            (queue,) = api.get("/api/queues").json()["items"]
            return queue["rate_limit"]

        assert shown() is None
        assert post("600/h").json() == {"name": "reports", "rate_limit": "10/m"}
        assert shown() == "10/m"
        bad = post("often")
        assert bad.status_code == 400 and "is not a rate limit" in bad.json()["error"]
        assert post(5).status_code == 400
        assert post(None).json() == {"name": "reports", "rate_limit": None}
        assert shown() is None


# -- the accepted range (issue 27) ------------------------------------------------------
#: Rates Celery parses that no queue can be held to: a wait longer than a day, or a
#: job more often than one a microsecond.
OUT_OF_RANGE = ("1e-300/s", "1e-13/s", "0.04/h", "2e6/s", "1.5e6/s", "1e400/s", 1e-9)


def test_rates_outside_the_range_are_refused_naming_it() -> None:
    for bad in OUT_OF_RANGE:
        with pytest.raises(ValueError, match=r"from 1 job a day .* to 1,000,000/s"):
            interval_us(bad)
    assert interval_us("1000000/s") == 1
    assert interval_us("0.042/h") == round(1_000_000 / (0.042 / 3600))
    assert interval_us(1 / 86_400) == 86_400_000_000
    app = Celery("ranges", set_as_current=False)

    @app.task(name="slowest", rate_limit="1e-13/s", shared=False)
    def slowest() -> None: ...

    with pytest.raises(ValueError, match=r"task 'slowest' has rate_limit='1e-13/s'.*1 job a day"):
        job_rate_limits(app)


def test_cli_and_api_refuse_a_rate_outside_the_range(broker_url: str,
                                                     redis_client: redis.Redis) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    from celery_ext.admin.web import create_app

    out = celery_cli("-A", "tests.apps.proj", "ext", "rate-limit", "reports", "1e-300/s",
                     broker_url=broker_url)
    assert out.returncode == 2 and "from 1 job a day" in out.stderr, out.stderr[-2000:]
    with TestClient(create_app(Client(redis_client), sample_interval=60)) as api:
        headers = {"X-CSRF-Token": api.get("/api/csrf").json()["csrf_token"]}
        for rate in ("1e-300/s", "1e-13/s", "2e6/s"):
            r = api.post("/api/queues/rate_limit", headers=headers,
                         json={"name": "reports", "rate_limit": rate})
            assert r.status_code == 400 and "from 1 job a day" in r.json()["error"], r.text
    assert Client(redis_client).rate_limits() == {}


def test_fetch_clamps_the_wait_of_a_limit_stored_out_of_range(redis_client: redis.Redis) -> None:
    """A limit written before the range was checked (or by hand) still gives the pool a
    wait it can sleep on: at most a day, never Redis's integer overflow."""
    for i in range(2):
        push(redis_client, "slow", json.dumps({"n": i}))
    redis_client.hset(K.rate_limits, "slow", "1" + "0" * 306)
    jobs, blocked, waits = fetch(redis_client, "slow")
    assert len(jobs) == 1 and blocked == ["slow"]
    assert 0 < waits["slow"] <= 86_400_000_000, waits
    jobs, blocked, waits = fetch(redis_client, "slow")
    assert jobs == [] and 0 < waits["slow"] <= 86_400_000_000, waits


def test_remote_control_refuses_a_rate_outside_the_range_and_keeps_the_last(
        proj_rate: Any, broker_url: str, redis_client: redis.Redis,
        worker_factory: Factory) -> None:
    """``celery control rate_limit`` with a rate out of range: the reply names the range,
    the limit in Redis stays, and the worker takes later changes of any task (the
    refused value is not left on the task to break every later reset)."""
    start_workers(worker_factory, 1, app="tests.apps.proj_rate", pool="threads",
                  concurrency=2)
    client = Client(redis_client)
    assert client.rate_limits() == {"rated": "20/s"}

    def control(task: str, rate: str) -> str:
        out = celery_cli("-A", "tests.apps.proj_rate", "control", "rate_limit", task, rate,
                         broker_url=broker_url)
        return str(out.stdout + out.stderr)

    assert "1 job a day" in control("tests.apps.proj_rate.rated", "1e-13/s")
    assert client.rate_limits() == {"rated": "20/s"}
    assert "error" not in control("tests.apps.proj_rate.unrated", "3/s").lower()
    limits = wait_for(lambda: (lambda got: got if len(got) == 2 else None)(
        client.rate_limits()), 10, "the other task's limit")
    assert limits["rated"] == "20/s" and sorted(limits.values()) == ["20/s", "3/s"], limits
