"""Per-key rate limits (issue 37): the task option ``fair_rate_limit`` spaces the jobs of
each fair key in all pools together, in the fetch, while other keys run on.

The fetch script itself against a real server (a key passed over, the wait, the state
that expires), the option's checks, the readers (``Client``, the CLI, the JSON API), then
real ``celery worker`` pools: two pools of ``tests.apps.proj_paced`` in both modes, threads
and prefork, each key's runs counted on the Redis clock.
"""

from __future__ import annotations

import json
import time
import warnings

import pytest
import redis
from celery import Celery

from celery_ext.admin.web import create_app
from celery_ext.client import Client
from celery_ext.options.checks import check_task, refuse_bad_options
from celery_ext.options.fair import job_fair_rates, write_fair_rates
from celery_ext.options.rate_limits import interval_us
from celery_ext.store.keys import Keys
from tests.helpers import Factory, Mode, celery_cli, push, start_workers, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes
from tests.integration.test_bad_input import run_worker_once
from tests.integration.test_rate_limits import fetch

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
APP = "tests.apps.proj_paced"


def keyed(n: int, key: str) -> str:
    """A payload whose fair key the scripts find (the property written last)."""
    return json.dumps({"n": n, "properties": {"fair_key": key}})


def early_by(stamps: list[int], interval: int) -> int:
    """How much earlier than one ``interval`` apart (µs) the closest-packed of ``stamps``
    are: the most, over every pair i < j, of (j - i) * interval - (stamp_j - stamp_i)."""
    stamps = sorted(stamps)
    return max((j - i) * interval - (stamps[j] - stamps[i])
               for i in range(len(stamps)) for j in range(i + 1, len(stamps)))


# -- the option -----------------------------------------------------------------------------
def test_the_option_is_bounded_like_the_queue_limit_at_start_and_publish(
        broker_url: str) -> None:
    """A fair_rate_limit that is not a rate, or out of rate_limit's range, is one line
    naming the task (the check a worker runs at start and an install(app) producer at
    publish); tasks sharing a queue get the strictest per-key rate."""
    app = Celery("fair-rates", broker=broker_url, set_as_current=False)

    @app.task(name="r.a", queue="q", fair_rate_limit="5/s", shared=False)
    def a() -> None: ...

    @app.task(name="r.b", queue="q", fair_rate_limit="1/s", shared=False)
    def b() -> None: ...

    @app.task(name="r.c", shared=False)
    def c() -> None: ...

    # (Only this app's own queue: Celery adds every shared task declared anywhere in the
    # process to an app it finalizes, and a test app imported earlier declares some.)
    rates = job_fair_rates(app)
    assert rates["q"] == 1_000_000 and "r.c" not in rates, rates
    for bad, why in (("often", "is not a rate limit"), ("10/d", "is not a rate limit"),
                     ("2000000/s", "is out of range")):
        c.fair_rate_limit = bad
        with pytest.raises(ValueError, match=rf"task 'r\.c' has fair_rate_limit='{bad}': .*{why}"):
            check_task(c)
    refuse_bad_options(app)
    with pytest.raises(ValueError, match=r"task 'r\.c' has fair_rate_limit='2000000/s'"):
        c.apply_async()
    app.close()


@pytest.mark.parametrize(("value", "why"), [("10/d", "is not a rate limit like '20/s'"),
                                             ("2000000/s", "is out of range")])
def test_a_bad_per_key_rate_stops_the_worker_with_one_line(
        broker_url: str, value: str, why: str) -> None:
    code, lines = run_worker_once("tests.apps.proj_bad", {
        "CELERY_EXT_BROKER_URL": broker_url,
        "PROJ_BAD_OPTIONS": json.dumps({"fair_rate_limit": value})})
    assert code == 1, lines
    assert len(lines) == 1 and lines[0].startswith(
        f"celery_ext: task 'tests.apps.proj_bad.configured' has fair_rate_limit={value!r}: "
        f"{value!r} {why}"), lines


# -- the fetch script -----------------------------------------------------------------------
def test_fetch_passes_over_a_key_not_due_and_its_state_expires(
        redis_client: redis.Redis) -> None:
    """Per-key 1/s: one job of each key, then the queue is blocked with the earliest wait
    while another key with jobs is due; a key's state is gone once it is due (an idle
    key leaves nothing behind); a changed limit keeps the keys' states."""
    for i in range(3):
        push(redis_client, "q", keyed(i, "A"))
    push(redis_client, "q", keyed(0, "B"))
    assert write_fair_rates(redis_client, K, {"q": interval_us("1/s") or 0}, ["q"]) == ["q"]
    jobs, blocked, waits = fetch(redis_client, "q", "q", "q")
    assert [json.loads(j[2])["properties"]["fair_key"] for j in jobs] == ["A", "B"]
    assert blocked == ["q"] and 900_000 <= waits["q"] <= 1_000_000
    assert 0 < redis_client.pttl(K.fair_due("q", "A")) <= 1000
    assert 0 < redis_client.pttl(K.fair_due("q", "B")) <= 1000
    # B drained; a new job of C is due at once while A is not.
    push(redis_client, "q", keyed(0, "C"))
    jobs, blocked, waits = fetch(redis_client, "q", "q")
    assert [json.loads(j[2])["properties"]["fair_key"] for j in jobs] == ["C"]
    assert blocked == ["q"] and 0 < waits["q"] <= 1_000_000
    # The queue's own rate limit (none here) and stats are untouched.
    assert redis_client.hget(K.rate_limits, "q") is None
    assert redis_client.hget(K.stats, "rate_limited") is None
    wait_for(lambda: not redis_client.exists(K.fair_due("q", "A"), K.fair_due("q", "B"),
                                             K.fair_due("q", "C")), 3, "the states to expire")
    jobs, blocked, waits = fetch(redis_client, "q")
    assert len(jobs) == 1 and waits == {}
    # Without the limit, A's state (one interval) still holds, then A's last job comes
    # and nothing is left.
    assert write_fair_rates(redis_client, K, {}, ["q"]) == ["q"]
    jobs, blocked, waits = fetch(redis_client, "q")
    assert jobs == [] and blocked == ["q"] and 0 < waits["q"] <= 1_000_000
    wait_for(lambda: fetch(redis_client, "q")[0], 3, "A's last job")
    assert not redis_client.exists(K.fair_due("q", "A"), K.fair_ring("q"))
    assert redis_client.hgetall(K.rate_limits) == {}


def test_client_cli_and_dashboard_show_the_per_key_limit_and_keys_not_due(
        broker_url: str, redis_client: redis.Redis) -> None:
    for i in range(3):
        push(redis_client, "q", keyed(i, "big"))
    push(redis_client, "q", keyed(0, "small"))
    write_fair_rates(redis_client, K, {"q": interval_us("6/m") or 0}, ["q"])
    fetch(redis_client, "q")  # big's first job: big is not due for 10 s
    fair = {q["name"]: q for q in Client(redis_client).job_queues()}["q"]["fair"]
    assert fair is not None and fair["rate_limit"] == "6/m"
    assert [k for k, _ in fair["not_due"]] == ["big"] and 8 < fair["not_due"][0][1] <= 10
    assert Client(redis_client).rate_limits() == {}  # the queue itself has none
    out = celery_cli("-A", "tests.apps.proj", "ext", "queues", broker_url=broker_url)
    assert out.returncode == 0, out.stderr
    assert "6/m per key; not due: big " in out.stdout, out.stdout
    with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    with TestClient(create_app(Client(redis_client), sample_interval=0.2)) as api:
        shown = api.get("/api/queues").json()["items"][0]["fair"]
        assert shown["rate_limit"] == "6/m" and shown["not_due"][0][0] == "big"


# -- real pools -----------------------------------------------------------------------------
#: How late a job may start after its fetch (µs): a prefork child's first job, which
#: connects the recorder, started 0.7 s after its fetch on the shared test machine.
START_TOLERANCE_US = 800_000


@pytest.mark.parametrize(("pool", "concurrency"), [("threads", 4), ("prefork", 2)])
def test_each_key_holds_its_rate_over_two_pools_and_keys_are_independent(
        mode: Mode, pool: str, concurrency: int, rec: redis.Redis,
        redis_client: redis.Redis, worker_factory: Factory) -> None:
    """fair_rate_limit="5/s" over two pools: the 10 runs of each of keys A and B start
    no closer than one interval (200 ms) apart per job between them, less the start
    tolerance (a job starts after its fetch, which the limit spaces); the two keys
    run side by side, not one after the other."""
    from tests.apps import proj_paced

    paced = proj_paced.paced
    interval = interval_us(proj_paced.KEY_RATE) or 0
    start_workers(worker_factory, 2, APP, pool=pool, concurrency=concurrency,
                  queues=["paced"], env=mode.env(acks_late=True))
    assert redis_client.hget(K.rate_limits, "paced\n") == str(interval).encode()
    for i in range(10):
        for key in ("A", "B"):
            mode.send(paced, key, i, queue="paced")
    wait_for(lambda: rec.llen("paced:A") == 10 and rec.llen("paced:B") == 10, 60,
             "20 jobs run")
    runs = {key: sorted(int(v) for v in rec.lrange(f"paced:{key}", 0, -1))
            for key in ("A", "B")}
    for key, stamps in runs.items():
        assert early_by(stamps, interval) <= START_TOLERANCE_US, (key, stamps)
    # Independent: each key's first run came before the other's third.
    assert runs["A"][0] < runs["B"][2] and runs["B"][0] < runs["A"][2], runs
    # Once drained, no key's state is left.
    wait_for(lambda: not list(redis_client.scan_iter(match="*queue:paced\x06\x18*")), 5,
             "the keys' states to expire")


def test_no_polling_while_every_key_waits(redis_client: redis.Redis, rec: redis.Redis,
                                          worker_factory: Factory, broker_url: str) -> None:
    """One key at 5/s with 6 jobs and a threads pool: the fetches refused meanwhile stay
    a few per job (the pool sleeps until the key is due instead of polling)."""
    from tests.apps import proj, proj_paced

    proj.configure(broker_url)
    worker_factory(APP, pool="threads", concurrency=4, queues=["paced"]).start(timeout=60)
    before = int(redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    started = time.monotonic()
    for i in range(6):
        proj_paced.paced.apply_async(("A", i), queue="paced")
    wait_for(lambda: rec.llen("paced:A") == 6, 30, "6 jobs run")
    calls = int(redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]) - before
    # 6 jobs over ~1 s: publishes, fetches and acks; a poll every ms would be ~1,000.
    assert calls < 6 * 12, (calls, time.monotonic() - started)
