"""``celery -A tests.apps.proj_web ext ...`` as a user runs it: subprocesses against a live
Redis and a real worker."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from celery_ext.client import Client
from tests.apps import proj_web
from tests.webutil import run_cli, wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown


def ok(broker_url: str, *args: str) -> str:
    result = run_cli(broker_url, *args)
    assert result.returncode == 0, f"{args}: rc={result.returncode}\n{result.stderr[-2000:]}"
    return str(result.stdout)


def as_json(broker_url: str, *args: str) -> Any:
    return json.loads(ok(broker_url, *args, "--json"))


def fails(broker_url: str, *args: str, code: int = 1) -> str:
    result = run_cli(broker_url, *args)
    assert result.returncode == code, f"{args}: rc={result.returncode}\n{result.stdout}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 or code == 2, result.stderr  # one-line errors
    return str(result.stderr)


def test_cli_against_a_live_worker(broker_url: str, redis_client: redis.Redis,
                                   worker_factory: Callable[..., WorkerProcess]) -> None:
    proj_web.configure(broker_url)
    client = Client.for_app(proj_web.app)
    worker_factory(proj_web.__name__, concurrency=2).start()
    proj_web.echo.delay(1).get(timeout=20)
    dead_job = proj_web.fragile.delay("k-cli", "<b>x</b>")
    later = proj_web.echo.apply_async((2,), countdown=300)
    proj_web.flaky.delay("k-cli-retry", 300)
    running = proj_web.progress.delay(3000, 0.1)
    wait_for(lambda: client.counts() == {"scheduled": 1, "retry": 1, "dead": 1},
             what="one job in each set")
    wait_for(lambda: client.busy_workers(), what="a busy worker")

    # Commands that change nothing, a few at a time (each is a Python start-up): the
    # reads, and the refusals, which leave every set as it was.
    dead_id = client.dead()["items"][0]["id"]
    reads: dict[tuple[str, ...], Any] = {
        cmd: None for cmd in [
            ("status",), ("status", "--json"), ("queues", "--json"),
            ("queues", "--prefix", "tests.apps.proj_web.e"), ("pools", "--json"), ("pools",),
            ("busy", "--json"), ("busy",), ("scheduled", "--json"), ("scheduled",),
            ("retry", "--json"), ("retry",), ("dead", "ls", "--json"), ("dead", "ls"),
            ("job", dead_job.id, "--json"), ("job", running.id, "--json"),
            ("dead", "show", dead_id), ("dead", "show", dead_id, "--json"), ("reap", "--json"),
        ]}
    refusals: dict[tuple[str, ...], int] = {
        ("dead", "show", "nope"): 1, ("dead", "rm", "gone"): 1,
        ("dead", "retry"): 2,  # neither ids nor --all: usage error
        ("dead", "rm", "x", "--all"): 2,
    }
    with ThreadPoolExecutor(3) as threads:
        refused = {cmd: threads.submit(fails, broker_url, *cmd, code=code)
                   for cmd, code in refusals.items()}
        for cmd, out in zip(reads, threads.map(lambda c: ok(broker_url, *c), reads), strict=True):
            reads[cmd] = json.loads(out) if "--json" in cmd else out
        errors = {cmd: future.result() for cmd, future in refused.items()}

    text = reads["status",]
    assert "dead 1" in text and "scheduled 1" in text and "tests.apps.proj_web.echo" in text
    status = reads["status", "--json"]
    assert status["summary"]["busy"] == 1 and status["summary"]["dead"] == 1
    assert len(status["pools"]) == 1

    names = {q["name"] for q in reads["queues", "--json"]}
    assert {"tests.apps.proj_web.echo", "tests.apps.proj_web.fragile"} <= names
    table = reads["queues", "--prefix", "tests.apps.proj_web.e"]
    assert table.splitlines()[0].split()[:2] == ["QUEUE", "QUEUED"]
    assert "tests.apps.proj_web.echo" in table and "fragile" not in table

    pools = reads["pools", "--json"]
    assert len(pools) == 1 and pools[0]["state"] == "running"
    assert pools[0]["pool_id"] in reads["pools",]

    busy = reads["busy", "--json"]
    assert busy[0]["job_id"] == running.id
    assert running.id in reads["busy",]

    scheduled = reads["scheduled", "--json"]
    assert scheduled["total"] == 1 and scheduled["items"][0]["task_id"] == later.id
    assert later.id in reads["scheduled",]
    retry = reads["retry", "--json"]
    assert retry["total"] == 1 and retry["items"][0]["name"] == "tests.apps.proj_web.flaky"
    assert "tests.apps.proj_web.flaky" in reads["retry",]

    dead = reads["dead", "ls", "--json"]
    assert [item["id"] for item in dead["items"]] == [dead_id]
    assert dead["items"][0]["task_id"] == dead_job.id
    assert dead_id in reads["dead", "ls"]
    job = reads["job", dead_job.id, "--json"]
    assert job["state"] == "dead" and job["dead_id"] == dead_id
    assert reads["job", running.id, "--json"]["state"] == "running"

    assert "asked job" in ok(broker_url, "stop", running.id)
    assert running.get(timeout=20)["stopped_at"] < 3000

    shown = reads["dead", "show", dead_id]
    assert "Traceback" in shown and "RuntimeError: k-cli is not ready" in shown
    assert reads["dead", "show", dead_id, "--json"]["payload"]
    assert "no dead job nope" in errors["dead", "show", "nope"]
    assert "not in the dead set" in errors["dead", "rm", "gone"]
    assert set(reads["reap", "--json"]) == {"dead_pools", "requeued", "dead_jobs", "skipped",
                                            "waiting", "watched"}

    assert "paused tests.apps.proj_web.echo" in ok(broker_url, "pause", "tests.apps.proj_web.echo")
    assert next(q for q in as_json(broker_url, "queues")
                if q["name"] == "tests.apps.proj_web.echo")["paused"] is True
    assert "already paused" in ok(broker_url, "pause", "tests.apps.proj_web.echo")
    assert "resumed" in ok(broker_url, "resume", "tests.apps.proj_web.echo")

    redis.Redis.from_url(proj_web.backend_url(broker_url, db=2)).set("k-cli", 1)
    assert "retried 1 dead job(s)" in ok(broker_url, "dead", "retry", dead_id)
    wait_for(lambda: proj_web.app.backend.get_task_meta(dead_job.id, cache=False)["status"]
             == "SUCCESS", what="the retried job to succeed")
    assert "not in the dead set: " + dead_id in fails(broker_url, "dead", "retry", dead_id)

    proj_web.fragile.delay("k-cli-2")
    proj_web.fragile.delay("k-cli-3")
    wait_for(lambda: client.counts()["dead"] == 2, what="two dead jobs")
    assert "deleted 2 dead job(s)" in ok(broker_url, "dead", "rm", "--all", "--yes")


def test_cli_errors_are_one_line(redis_server: Any) -> None:
    # Redis down; the password in the URL must not be echoed back.
    down = "celery-ext://:hunter2@127.0.0.1:1/0"
    err = fails(down, "status")
    assert err.startswith("Error: cannot reach Redis") and "hunter2" not in err
    # A broker that is not ours.
    plain = redis_server.url(scheme="redis")
    result = run_cli(plain, "queues")
    assert result.returncode == 1 and "celery-ext://" in result.stderr


def test_job_command_refuses_an_unknown_id_and_shows_local_times(
        broker_url: str, redis_client: redis.Redis) -> None:
    proj_web.configure(broker_url)
    later = proj_web.echo.apply_async((2,), countdown=300)
    queued = proj_web.echo.delay(3)  # no worker: it stays queued
    err = fails(broker_url, "job", "no-such-job-id")
    assert "unknown job id no-such-job-id" in err, err
    assert as_json(broker_url, "job", queued.id)["state"] == "queued"
    text = ok(broker_url, "job", later.id)
    due = next(line for line in text.splitlines() if line.startswith("due_at"))
    assert re.fullmatch(r"due_at +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", due), text


def test_web_on_a_busy_port_is_one_line_and_no_url(broker_url: str,
                                                  redis_client: redis.Redis) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = fails(broker_url, "web", "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in err and "dashboard on" not in err, err
