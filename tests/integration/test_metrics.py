"""Prometheus metrics: the ``/metrics`` text against a real server and worker, the
counters kept where their event happens, and a real Prometheus (Debian's package)
scraping a live dashboard and ``celery ext metrics``, with the alert rules of
``docs/operations.md`` loaded."""

from __future__ import annotations

import json
import re
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry

with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from celery_ext.admin.metrics import Snapshot, families, read_snapshot, registry_for
from celery_ext.admin.web import create_app
from celery_ext.client import Client
from celery_ext.config import WAIT_BUCKETS, Settings
from celery_ext.worker.observer import RUNTIME_BUCKETS
from celery_ext.worker.reaper import Reaper
from tests.apps import proj, proj_web
from tests.debian import ensure_installed
from tests.deploy_config import CONFIG
from tests.helpers import K, message, node_name, only_pool
from tests.webutil import celery_argv, env_for, free_port, start_web, stop_all, wait_for
from tests.workers import REPO_ROOT, ManagedProcess, WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

TOKEN = "metrics-test-token"
ECHO = "tests.apps.proj_web.echo"
PROGRESS = "tests.apps.proj_web.progress"
FRAGILE = "tests.apps.proj_web.fragile"
RULES = CONFIG / "prometheus" / "celery-ext-rules.yml"
RULES_TEST = RULES.with_name("celery-ext-rules.test.yml")
GRAFANA = CONFIG / "grafana" / "celery-ext-dashboard.json"
OPERATIONS = REPO_ROOT / "docs" / "operations.md"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition text: (name, labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(got: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float | None:
    return got.get((name, frozenset(labels.items())))


def test_metrics_text_against_a_live_worker(
        ext_client: Client, redis_client: redis.Redis,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory(proj_web.__name__, concurrency=2).start()
    ext_client.pause(PROGRESS)
    enqueued = time.time()
    for _ in range(3):
        proj_web.progress.delay(1, 0.0)
    for i in range(5):
        proj_web.echo.delay(i)
    proj_web.fragile.delay("never-set")  # fails once, not retried: the dead set
    proj_web.echo.apply_async(("later",), countdown=300)
    redis_client.hset(K.stats, "rate_limited", 7)  # written by the rate-limit fetch path

    with TestClient(create_app(ext_client, token=TOKEN)) as api:
        assert api.get("/metrics").status_code == 401

        def scrape() -> dict[Any, float] | None:
            r = api.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            got = samples(r.text)
            done = (value(got, "celery_ext_jobs_processed_total", queue=ECHO) == 5
                    and value(got, "celery_ext_jobs_failed_total", queue=FRAGILE) == 1)
            return got if done else None

        got = wait_for(scrape, timeout=30, what="5 echo jobs processed, 1 fragile failed")
    seen = time.time()
    pool = only_pool(redis_client)

    assert value(got, "celery_ext_up") == 1
    assert value(got, "celery_ext_queue_depth", queue=PROGRESS) == 3
    assert value(got, "celery_ext_queue_paused", queue=PROGRESS) == 1
    assert value(got, "celery_ext_queue_paused", queue=ECHO) == 0
    latency = value(got, "celery_ext_queue_latency_seconds", queue=PROGRESS)
    assert latency is not None and 0 < latency <= seen - enqueued + 1
    assert value(got, "celery_ext_queue_latency_seconds", queue=ECHO) == 0
    assert value(got, "celery_ext_queue_in_flight_jobs", queue=ECHO) == 0
    assert value(got, "celery_ext_scheduled_jobs") == 1
    assert value(got, "celery_ext_retry_jobs") == 0
    assert value(got, "celery_ext_dead_jobs") == 1
    assert value(got, "celery_ext_rate_limited_fetches_total") == 7
    for name in ("jobs_recovered", "pools_reaped", "poison_pills", "unique_hits"):
        assert value(got, f"celery_ext_{name}_total") == 0

    # The runtime histogram: cumulative buckets ending at the count of runs.
    buckets = [value(got, "celery_ext_job_runtime_seconds_bucket", queue=ECHO, le=le)
               for le in (*(repr(b) for b in RUNTIME_BUCKETS), "+Inf")]
    assert all(b is not None for b in buckets)
    assert buckets == sorted(buckets) and buckets[-1] == 5  # type: ignore[type-var]
    assert value(got, "celery_ext_job_runtime_seconds_count", queue=ECHO) == 5
    total = value(got, "celery_ext_job_runtime_seconds_sum", queue=ECHO)
    assert total is not None and 0 < total < 5 * 10
    assert value(got, "celery_ext_job_runtime_seconds_count", queue=FRAGILE) == 1

    assert value(got, "celery_ext_pool_alive", pool=pool, node=node_name(worker)) == 1
    assert value(got, "celery_ext_pool_concurrency", pool=pool) == 2
    assert value(got, "celery_ext_pool_in_flight_jobs", pool=pool) == 0
    assert value(got, "celery_ext_pool_busy_slots", pool=pool) == 0
    age = value(got, "celery_ext_pool_heartbeat_age_seconds", pool=pool)
    assert age is not None and 0 <= age < Settings().dead_after


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_wait_histogram_counts_enqueue_to_start_per_queue(
        ext_client: Client, redis_client: redis.Redis, pool: str,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """``celery_ext_job_wait_seconds``: jobs held in a paused queue for PAUSED seconds land
    above the bucket below PAUSED; a countdown job's wait counts from its due time, not
    from its enqueue, so it lands below the bucket its countdown would reach."""
    paused_for, countdown = 3.0, 6.0
    above = repr(max(b for b in WAIT_BUCKETS if b < paused_for))  # "2.5"
    below = repr(max(b for b in WAIT_BUCKETS if b < countdown))  # "5.0"
    worker_factory(proj_web.__name__, pool=pool, concurrency=2).start()

    def scrape(count: int) -> dict[Any, float] | None:
        got = samples("".join(_exposition(read_snapshot(ext_client.state))))
        done = value(got, "celery_ext_job_wait_seconds_count", queue=ECHO) == count
        return got if done else None

    def bucket(got: dict[Any, float], le: str) -> float:
        n = value(got, "celery_ext_job_wait_seconds_bucket", queue=ECHO, le=le)
        assert n is not None, le
        return n

    proj_web.echo.delay("first")  # the worker runs: nothing held
    first = wait_for(lambda: scrape(1), timeout=30, what="the first job's wait written")
    assert value(first, "celery_ext_job_wait_seconds_count", queue=PROGRESS) is None

    ext_client.pause(ECHO)
    for i in range(2):
        proj_web.echo.delay(i)
    time.sleep(paused_for)
    ext_client.resume(ECHO)
    got = wait_for(lambda: scrape(3), timeout=30, what="the held jobs' waits written")
    assert bucket(got, above) == bucket(first, above)  # both held jobs waited longer
    assert bucket(got, "+Inf") == bucket(first, "+Inf") + 2
    total = value(got, "celery_ext_job_wait_seconds_sum", queue=ECHO)
    before = value(first, "celery_ext_job_wait_seconds_sum", queue=ECHO)
    assert total is not None and before is not None
    # Each waited at least the pause (less the clocks' few ms of disagreement).
    assert total - before >= 2 * paused_for - 0.1

    proj_web.echo.apply_async(("later",), countdown=countdown)
    last = wait_for(lambda: scrape(4), timeout=30, what="the countdown job's wait written")
    assert bucket(last, below) == bucket(got, below) + 1  # counted from its due time
    buckets = [bucket(last, repr(b)) for b in WAIT_BUCKETS] + [bucket(last, "+Inf")]
    assert buckets == sorted(buckets) and buckets[-1] == 4


def test_reaper_counts_recovered_jobs_reaped_pools_and_poison_pills(
        redis_client: redis.Redis) -> None:
    """A dead pool owning three jobs, one of them already recovered max_recoveries
    times: the reaper requeues two and dead-letters the third, and counts each."""
    settings = Settings()
    pool, queue = "ghost:1:abc", "tests.q"
    redis_client.zadd(K.pools, {pool: 0})
    redis_client.hset(K.pool(pool), "dead_after_ms", 1000)
    redis_client.sadd(K.inflight_pools, pool)
    for tag in ("t1", "t2", "t3"):
        redis_client.hset(K.inflight(pool), tag, f"{queue}\n{json.dumps(message(tag, queue))}")
    redis_client.hset(K.running, queue, 3)
    redis_client.sadd(K.queues, queue)  # known since the jobs were enqueued
    redis_client.hset(K.redelivery, "t3", settings.max_recoveries)

    result = Reaper(redis_client, settings).reap()
    assert result.dead_pools == [pool]
    assert sorted(result.requeued) == ["t1", "t2"] and result.dead_jobs == ["t3"]

    redis_client.script_flush()  # as after a server restart: the scrape loads its script
    snap = read_snapshot(Client(redis_client).state)
    got = samples("".join(_exposition(snap)))
    assert value(got, "celery_ext_jobs_recovered_total") == 2
    assert value(got, "celery_ext_poison_pills_total") == 1
    assert value(got, "celery_ext_pools_reaped_total") == 1
    assert value(got, "celery_ext_queue_depth", queue=queue) == 2
    assert value(got, "celery_ext_dead_jobs") == 1


def test_unique_hits_counted(broker_url: str, redis_client: redis.Redis) -> None:
    """An enqueue dropped as a duplicate counts one hit, pushed or scheduled alike."""
    proj.configure(broker_url)
    from tests.apps import proj_sets

    first = proj_sets.unique_by_key.delay("a", 1)
    assert proj_sets.unique_by_key.delay("a", 2).id == first.id  # dropped: a hit
    assert proj_sets.unique_by_key.delay("b", 1).id != first.id  # another key: no hit
    later = proj_sets.unique_job.apply_async(("s",), countdown=60)
    assert proj_sets.unique_job.apply_async(("s",), countdown=60).id == later.id
    assert read_snapshot(Client(redis_client).state).stats["unique_hits"] == 2


def test_unreachable_redis_reports_up_0(caplog: pytest.LogCaptureFixture) -> None:
    """Redis down: the scrape still answers, with ``celery_ext_up 0`` and nothing else,
    and the outage is logged once."""
    down = Client(redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0)))
    registry = registry_for(down)
    texts = [generate_latest(registry).decode() for _ in range(2)]
    assert all(samples(t) == {("celery_ext_up", frozenset()): 0.0} for t in texts)
    assert len([r for r in caplog.records if "cannot read Redis" in r.message]) == 1


def _exposition(snap: Snapshot) -> Iterator[str]:
    """The text format of one snapshot, as the endpoint writes it."""
    class One:
        def collect(self) -> Any:
            return families(snap)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())  # type: ignore[arg-type]
    yield generate_latest(registry).decode()


def metric_names() -> set[str]:
    """Every sample name the endpoint can write (from the families of an empty read),
    and the histogram's own name."""
    names = {"celery_ext_up"}
    for family in families(Snapshot()):
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("", "_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def test_docs_use_real_metric_names() -> None:
    """The alert rules, the Grafana dashboard and the autoscaling examples name only
    metrics the endpoint writes; the dashboard is valid JSON with a query per panel."""
    known = metric_names()
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs and all(p.get("targets") for p in dashboard["panels"] if p["type"] != "row")
    for text in (RULES.read_text(), "\n".join(exprs), OPERATIONS.read_text()):
        used = set(re.findall(r"\bcelery_ext_[a-z_]+", text))
        assert used and used <= known, used - known


# -- a real Prometheus ----------------------------------------------------------------------
PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"


def _ensure_prometheus() -> None:
    """Debian's prometheus (with promtool); the tests run the binary, never its service."""
    try:
        for path in (PROMETHEUS, PROMTOOL):
            ensure_installed("prometheus", path)
    except LookupError as exc:
        pytest.skip(str(exc))


def test_alert_rules_pass_promtool() -> None:
    """The rules file is valid, and its unit tests (firing and quiet cases) pass."""
    _ensure_prometheus()
    for args in (["check", "rules", RULES.name], ["test", "rules", RULES_TEST.name]):
        run = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60,
                             cwd=RULES.parent)
        assert run.returncode == 0 and "SUCCESS" in run.stdout + run.stderr, \
            run.stdout + run.stderr


def test_prometheus_scrapes_a_live_dashboard(
        ext_client: Client, tmp_path: Path,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """Prometheus scrapes the dashboard (with its token) and ``celery ext metrics``
    every second while a worker runs jobs: its query API returns the paused queue's
    depth and the worker's processed rate, and the alert rules evaluate."""
    _ensure_prometheus()
    broker_url = proj_web.app.conf.broker_url
    worker = worker_factory(proj_web.__name__, concurrency=2)
    worker.start(wait_ready=False)
    ext_client.pause(PROGRESS)
    for _ in range(4):
        proj_web.progress.delay(1, 0.0)
    procs: list[ManagedProcess] = []
    try:
        web, web_url = start_web(broker_url, tmp_path, "--token", TOKEN)
        procs.append(web)
        metrics_port = free_port()
        metrics_only = ManagedProcess(
            celery_argv("ext", "metrics", "--port", str(metrics_port)),
            log_path=tmp_path / "metrics.log", env=env_for(broker_url),
            ready_pattern=r"celery_ext metrics on http://")
        procs.append(metrics_only)
        metrics_only.start(timeout=30)
        prom_port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "dashboard", "authorization": {"credentials": TOKEN},
                 "static_configs": [{"targets": [web_url.split("//", 1)[1]]}]},
                {"job_name": "metrics",
                 "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]},
            ]}))
        prom = ManagedProcess(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            log_path=tmp_path / "prometheus.log", cwd=tmp_path,
            ready_pattern=r"Server is ready to receive web requests")
        procs.append(prom)
        prom.start(timeout=60)
        assert worker.ready_pattern
        worker.wait_for_log(worker.ready_pattern, timeout=60)
        api = f"http://127.0.0.1:{prom_port}/api/v1"

        def query(expr: str) -> dict[str, float]:
            r = httpx.get(f"{api}/query", params={"query": expr}, timeout=10)
            r.raise_for_status()
            return {row["metric"].get("job", ""): float(row["value"][1])
                    for row in r.json()["data"]["result"]}

        def echo_rate() -> dict[str, float] | None:
            proj_web.echo.delay("tick")  # keep the worker busy while Prometheus scrapes
            proj_web.echo.delay("tock")
            rate = query(f'rate(celery_ext_jobs_processed_total{{queue="{ECHO}"}}[5s])')
            return rate if len(rate) == 2 and min(rate.values()) > 0 else None

        rate = wait_for(echo_rate, timeout=45, interval=0.5, what="a processed rate")
        assert set(rate) == {"dashboard", "metrics"}
        depth = query(f'celery_ext_queue_depth{{queue="{PROGRESS}"}}')
        assert depth == {"dashboard": 4.0, "metrics": 4.0}
        assert query("celery_ext_up") == {"dashboard": 1.0, "metrics": 1.0}

        def rules_evaluated() -> list[dict[str, Any]] | None:
            groups = httpx.get(f"{api}/rules", timeout=10).json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if rules and all(r["health"] == "ok" for r in rules) else None

        rules = wait_for(rules_evaluated, timeout=20, what="every alert rule evaluated")
        assert {r["name"] for r in rules} >= {"CeleryExtQueueLatencyHigh", "CeleryExtNoLivePool",
                                             "CeleryExtDeadSetGrowing", "CeleryExtReaperRecovering"}
        # A live pool and no recovery: those two alerts stay quiet.
        firing = {r["name"] for r in rules if r["state"] != "inactive"}
        assert not firing & {"CeleryExtNoLivePool", "CeleryExtReaperRecovering"}, firing
    finally:
        stop_all(procs)
