"""A job queue no live worker pool consumes is marked, not silent (issue 33, item 5).

With ``install(app)`` every task name has its own job queue, so a job sent under a
name no worker knows (a typo, or a deploy not yet rolled out) waits in a queue no pool
consumes. The job is kept; ``Client``, the JSON API, the CLI and the metrics mark the
queue, and stop marking it once a pool that consumes it runs. Real server, real workers.
"""

from __future__ import annotations

import json
import signal
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import redis

with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from celery_ext.admin.api_types import QueueInfo
from celery_ext.admin.metrics import families, read_snapshot
from celery_ext.admin.web import create_app
from celery_ext.client import Client
from tests.apps import proj_web
from tests.helpers import K
from tests.webutil import run_cli, wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

ECHO = "tests.apps.proj_web.echo"
TYPO = "tests.apps.proj_web.ecko"  # no task of that name anywhere


def row(client: Client, name: str) -> QueueInfo | None:
    return next((q for q in client.job_queues() if q["name"] == name), None)


def unconsumed_metric(client: Client) -> dict[str, float]:
    """``celery_ext_queue_unconsumed`` by queue, as a scrape computes it."""
    snap = read_snapshot(client.state)
    family = next(f for f in families(snap) if f.name == "celery_ext_queue_unconsumed")
    return {s.labels["queue"]: s.value for s in family.samples}


def cli_queues(broker_url: str) -> tuple[dict[str, Any], str]:
    """``celery ext queues``: the JSON rows by name, and the table's line of TYPO."""
    as_json = run_cli(broker_url, "queues", "--json")
    assert as_json.returncode == 0, as_json.stderr
    table = run_cli(broker_url, "queues")
    assert table.returncode == 0, table.stderr
    line = next(line for line in table.stdout.splitlines() if line.startswith(TYPO))
    return {q["name"]: q for q in json.loads(as_json.stdout)}, line


def test_a_queue_no_live_pool_consumes_is_marked_until_one_does(
        ext_client: Client, broker_url: str, redis_client: redis.Redis,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    worker_factory(proj_web.__name__, concurrency=1).start()
    proj_web.echo.delay("known").get(timeout=30)
    proj_web.app.send_task(TYPO, args=("typo",))

    typo = wait_for(lambda: (r := row(ext_client, TYPO)) and r["size"] == 1 and r,
                    what="the typo's job queued")
    assert typo["consumed"] is False
    echo = row(ext_client, ECHO)
    assert echo is not None and echo["consumed"] is True

    with TestClient(create_app(ext_client)) as api:
        items = {q["name"]: q for q in api.get("/api/queues").json()["items"]}
    assert items[TYPO]["consumed"] is False and items[ECHO]["consumed"] is True

    rows, line = cli_queues(broker_url)
    assert rows[TYPO]["consumed"] is False and "no consumer" in line
    status = run_cli(broker_url, "status")
    assert status.returncode == 0 and "no live worker pool consumes" in status.stdout \
        and TYPO in status.stdout, status.stdout

    metric = unconsumed_metric(ext_client)
    assert metric[TYPO] == 1 and metric[ECHO] == 0

    # A pool that consumes the queue starts (paused, so the job stays and is seen
    # waiting): the queue is no longer marked.
    ext_client.pause(TYPO)
    second = worker_factory(proj_web.__name__, concurrency=1, queues=[TYPO]).start()
    wait_for(lambda: (r := row(ext_client, TYPO)) and r["consumed"],
             what="the typo's queue consumed by the second pool")
    assert unconsumed_metric(ext_client)[TYPO] == 0
    rows, line = cli_queues(broker_url)
    assert rows[TYPO]["consumed"] is True and "no consumer" not in line
    assert redis_client.llen(K.queue(TYPO)) == 1  # the job waited all along

    # That pool stops (it deregisters): marked again.
    second.stop(signal.SIGTERM)
    wait_for(lambda: (r := row(ext_client, TYPO)) and not r["consumed"],
             what="the typo's queue unconsumed again")
    assert unconsumed_metric(ext_client)[TYPO] == 1
