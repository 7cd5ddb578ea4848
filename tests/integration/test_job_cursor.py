"""A resumable job's cursor where one job is shown (issue 35): ``Client.job``, ``celery
ext job`` and ``/api/jobs/<id>`` (the job widget's source) carry it while the job runs,
and none once the job finished (its ack removes the cursor record)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable

import pytest
import redis

with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from celery_ext.admin.web import create_app
from celery_ext.client import Client
from tests.apps import proj_web
from tests.webutil import run_cli, wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

#: A cursor as a job keeps one: nested JSON, and a long text the CLI cuts.
CURSOR = {"page": 3, "after": "order-41", "note": "x" * 300}


def flag(key: str) -> None:
    """Set the Redis key a waiting job of ``tests.apps.proj_web`` waits for."""
    redis.Redis.from_url(proj_web.backend_url(proj_web.app.conf.broker_url, db=2)).set(key, 1)


def test_a_running_jobs_cursor_is_shown_and_gone_once_it_finished(
        broker_url: str, ext_client: Client,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    worker_factory(proj_web.__name__, concurrency=1).start()
    api = TestClient(create_app(ext_client))  # /api/jobs/<id>: what the job widget reads
    job = proj_web.keeps_cursor.delay("cursor-done", CURSOR)
    status = wait_for(lambda: (st := ext_client.job(job.id))["cursor"] and st,
                      what="the job's cursor in its status")
    assert status["state"] == "running" and status["cursor"] == CURSOR

    assert api.get(f"/api/jobs/{job.id}").json()["cursor"] == CURSOR
    shown = run_cli(broker_url, "job", job.id)
    assert shown.returncode == 0, shown.stderr
    (line,) = [line for line in shown.stdout.splitlines() if line.startswith("cursor ")]
    text = json.dumps(CURSOR)
    assert line.split(None, 1)[1] == text[:199] + "…"  # one line, cut to 200 characters
    as_json = run_cli(broker_url, "job", job.id, "--json")
    assert json.loads(as_json.stdout)["cursor"] == CURSOR

    flag("cursor-done")
    assert job.get(timeout=30) == "done"
    finished = wait_for(lambda: (st := ext_client.job(job.id))["cursor"] is None and st,
                        what="the finished job's cursor to go")
    assert finished["state"] == "succeeded"
    assert api.get(f"/api/jobs/{job.id}").json()["cursor"] is None
    shown = run_cli(broker_url, "job", job.id)
    assert shown.returncode == 0, shown.stderr
    assert not [line for line in shown.stdout.splitlines() if line.startswith("cursor ")]

