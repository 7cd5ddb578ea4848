"""One answer to "which job queue does this task's job go to" (issue 33, item 3).

Real server, real ``celery -A tests.apps.proj_routes worker -P threads -c 4`` subprocesses.
A task's limits, weight and the queues a worker without ``-Q`` consumes follow Celery's
router: ``task_routes`` as a dict or a router function, ``queue=`` on the task, and the
default queue of a drop-in app; a queue shared by tasks of different limits is one line
at worker start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ext.client import Client
from celery_ext.store.keys import Keys
from tests.apps.proj_routes import EXPLICIT, HEAVY, RATE, REPORT, SHARED_B, make_app
from tests.helpers import Factory, wait_for

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
APP = "tests.apps.proj_routes"
JOBS = 6


@pytest.fixture
def producer(broker_url: str, redis_client: redis.Redis) -> Iterator[Callable[..., Celery]]:
    """Build a producer like the worker's app: ``producer(routes, install)``."""
    apps: list[Celery] = []

    def make(routes: str, install: bool) -> Celery:
        apps.append(make_app(routes, install, broker_url))
        return apps[-1]

    yield make
    for app in apps:
        app.close()


def worker_env(routes: str, install: bool) -> dict[str, str]:
    env = {"PROJ_ROUTES": routes}
    if not install:
        env["CELERY_EXT_NO_INSTALL"] = "1"
    return env


def run_at_most_one(app: Celery, name: str, key: str, rec: redis.Redis, **options: Any) -> None:
    """Send JOBS jobs of a max_concurrency=1 task; all run, never two at once."""
    for _ in range(JOBS):
        app.tasks[name].apply_async((key, 0.3), **options)
    wait_for(lambda: rec.llen(f"runs:{key}") >= JOBS, 30, f"{JOBS} runs of {key}")
    assert int(rec.get(f"max:{key}") or 0) == 1


# (routes, install(app), the job queue of REPORT, -Q of the worker or None)
CASES = [
    ("dict", True, "reports", None),
    ("function", True, "reports", None),
    ("dict", False, "reports", ["reports"]),
    ("function", False, "reports", ["reports"]),
    ("none", False, "celery", None),
]


@pytest.mark.parametrize(("routes", "install", "queue", "queues"), CASES,
                         ids=[f"{r}-{'install' if i else 'dropin'}" for r, i, _, _ in CASES])
def test_max_concurrency_holds_on_the_routed_queue(
        routes: str, install: bool, queue: str, queues: list[str] | None,
        producer: Callable[..., Celery], rec: redis.Redis, redis_client: redis.Redis,
        worker_factory: Factory) -> None:
    """``max_concurrency=1`` with ``task_routes`` (dict, function) or the drop-in default
    queue: the jobs wait in the routed queue, a worker without ``-Q`` (install) consumes
    it, the limit is written for it, and never two run at once on 4 threads."""
    worker_factory(APP, pool="threads", concurrency=4, queues=queues,
                   env=worker_env(routes, install)).start()
    client = Client(redis_client)
    wait_for(lambda: client.limits().get(queue) == 1, 10, f"the limit of {queue}")
    run_at_most_one(producer(routes, install), REPORT, f"r-{routes}-{install}", rec)


@pytest.mark.parametrize("install", [True, False], ids=["install", "dropin"])
def test_max_concurrency_holds_on_the_tasks_own_queue(
        install: bool, producer: Callable[..., Celery], rec: redis.Redis,
        redis_client: redis.Redis, worker_factory: Factory) -> None:
    """``queue=`` on the task: its jobs and its limit are on that queue, and a worker
    without ``-Q`` consumes it with ``install(app)`` (drop-in: ``-Q`` names it)."""
    worker_factory(APP, pool="threads", concurrency=4,
                   queues=None if install else ["explicit_reports"],
                   env=worker_env("none", install)).start()
    client = Client(redis_client)
    wait_for(lambda: client.limits().get("explicit_reports") == 1, 10, "the limit")
    run_at_most_one(producer("none", install), EXPLICIT, f"e-{install}", rec)


def test_per_call_queue_counts_against_that_queues_limit(
        producer: Callable[..., Celery], rec: redis.Redis, worker_factory: Factory) -> None:
    """``apply_async(queue="reports")`` of a task routed elsewhere (HEAVY, no limit): the
    job waits in ``reports`` and counts against that queue's limit (REPORT's, 1): with
    REPORT's own jobs, never two of the queue run at once."""
    worker_factory(APP, pool="threads", concurrency=4, env=worker_env("dict", True)).start()
    sender, key = producer("dict", True), "per-call"
    for i in range(JOBS):
        sender.tasks[REPORT if i % 2 else HEAVY].apply_async((key, 0.3), queue="reports")
    wait_for(lambda: rec.llen(f"runs:{key}") >= JOBS, 30, f"{JOBS} runs")
    assert int(rec.get(f"max:{key}") or 0) == 1


@pytest.mark.parametrize("routes", ["dict", "function"])
def test_rate_limit_and_weight_follow_the_routed_queue(
        routes: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """The rate limit, the weight and the limits are written for the routed queues, none
    for the task names."""
    worker_factory(APP, pool="threads", concurrency=4, env=worker_env(routes, True)).start()
    client = Client(redis_client)
    wait_for(lambda: redis_client.hget(K.weights, "heavy_reports") == b"3", 10, "the weight")
    assert not redis_client.hexists(K.weights, HEAVY)
    assert client.rate_limits() == {"rated_reports": RATE}
    assert set(client.limits()) == {"reports", "shared", "explicit_reports"}


def test_a_queue_shared_by_tasks_of_different_limits_is_one_line_at_start(
        redis_client: redis.Redis, worker_factory: Factory) -> None:
    """Two tasks routed to ``shared`` with max_concurrency 1 and 3: the queue's limit is
    1, and the worker says so at start, naming the queue and the other task."""
    worker = worker_factory(APP, pool="threads", concurrency=4,
                            env=worker_env("dict", True)).start()
    line = worker.wait_for_log(r"celery_ext: job queue 'shared' has max_concurrency=1 .*")
    assert SHARED_B in line.group(0) and "max_concurrency=3" in line.group(0)
    assert Client(redis_client).limits()["shared"] == 1
