"""A user's test suite against celery-ext: the plugin ``celery_ext.pytest`` and Celery's
own ``celery.contrib.pytest`` fixtures, run by pytester in a subprocess on a small
project, each way with pytest-celery's plugin loaded and with ``-p no:celery``.

Each run checks the outcomes a user sees (a result, a raising job in the dead set, the
worker pool registered with its node and queues), and, at the end of the session, that
nothing of ours is left registered in Redis or running in the process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from celery_ext.testing.server import RedisServer

pytestmark = pytest.mark.timeout(240)

PROJECT = '''
import os

from celery import Celery

app = Celery("proj", broker="celery-ext://127.0.0.1:1/0")
if os.environ.get("PROJ_MODE") == "install":
    import celery_ext

    celery_ext.install(app)


@app.task
def add(a, b):
    return a + b


@app.task
def boom():
    raise KeyError("boom")


@app.task(bind=True)
def long_job(self, steps):
    for i in range(steps):
        self.checkin(progress=(i + 1) / steps)
    return steps
'''

#: Written by the project's conftest when its session ends: what of ours is left.
LEFTOVERS = '''
import json
import os
import threading


def pytest_sessionfinish(session, exitstatus):
    from celery_ext.worker.worker_pool import live_pools

    with open(os.environ["LEFTOVERS_FILE"], "w") as f:
        json.dump({
            "threads": sorted(t.name for t in threading.enumerate()
                              if t.name.startswith("celery_ext")),
            "pools": [p.pool_id for p in live_pools()],
        }, f)
'''

PLUGIN_TESTS = '''
import os
import time

import pytest

from proj import add, boom, long_job


def test_result(celery_ext_worker):
    assert add.delay(2, 2).get(timeout=10) == 4


def test_raising_job_is_dead_and_pool_registered(celery_ext_worker, celery_ext_client):
    result = boom.delay()
    with pytest.raises(KeyError):
        result.get(timeout=10)
    deadline = time.monotonic() + 10
    while celery_ext_client.counts()["dead"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    dead = celery_ext_client.dead()["items"]
    assert [job["task_id"] for job in dead] == [result.id]
    (pool,) = celery_ext_client.worker_pools()
    assert pool["node"] == celery_ext_worker.hostname
    assert pool["queues"], pool
    # The pool and concurrency the ini named (the plugin's defaults without).
    assert (pool["pool_type"], pool["concurrency"]) == (
        os.environ.get("EXPECT_POOL", "solo"), os.environ.get("EXPECT_CONCURRENCY", "1")), pool


def test_checkin_and_a_clean_namespace(celery_ext_worker, celery_ext_client):
    assert long_job.delay(3).get(timeout=10) == 3
    assert celery_ext_client.counts()["dead"] == 0  # the previous test's job is not here


def test_task_defined_after_the_worker_started(celery_ext_worker, celery_ext_configured_app):
    @celery_ext_configured_app.task(name="proj.late")
    def late():
        return "late"

    assert late.delay().get(timeout=10) == "late"
'''

CELERY_CONTRIB_TESTS = '''
import os
import time

import pytest

import celery_ext
from celery_ext.client import Client


@pytest.fixture(scope="session")
def celery_config():
    return {"broker_url": os.environ["BROKER_URL"], "result_backend": os.environ["BACKEND_URL"]}


@pytest.fixture
def celery_app(celery_app):
    if os.environ["PROJ_MODE"] == "install":
        celery_ext.install(celery_app)
    return celery_app


@pytest.fixture(scope="session")
def celery_worker_pool():
    return "solo"


def test_result_and_dead_set(celery_app, celery_worker):
    @celery_app.task(name="contrib.boom")
    def boom():
        raise KeyError("boom")

    @celery_app.task(name="contrib.add")
    def add(a, b):
        return a + b

    celery_worker.reload()
    assert add.delay(2, 3).get(timeout=10) == 5
    result = boom.delay()
    with pytest.raises(KeyError):
        result.get(timeout=10)
    client = Client.for_app(celery_app)
    deadline = time.monotonic() + 10
    while client.counts()["dead"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [job["task_id"] for job in client.dead()["items"]] == [result.id]
    (pool,) = client.worker_pools()
    assert pool["node"] == celery_worker.hostname
'''


PYTEST_CELERY_TESTS = '''
import time

from proj import add, boom

from celery_ext.client import Client


def test_setup_ready_and_a_job(celery_setup):
    assert celery_setup.ready(ping=True, control=True)
    assert celery_setup.app.control.ping(timeout=10, limit=1) == [
        {celery_setup.worker.hostname(): {"ok": "pong"}}]
    assert add.delay(2, 5).get(timeout=10) == 7
    client = Client.for_app(celery_setup.app)
    (pool,) = client.worker_pools()
    assert pool["node"] == celery_setup.worker.hostname()


def test_raising_job_is_dead(celery_setup):
    result = boom.delay()
    try:
        result.get(timeout=10)
    except KeyError:
        pass
    client = Client.for_app(celery_setup.app)
    deadline = time.monotonic() + 10
    while client.counts()["dead"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [job["task_id"] for job in client.dead()["items"]] == [result.id]


def test_worker_killed_and_restarted(celery_setup):
    worker = celery_setup.worker
    worker.kill()
    worker.restart()
    assert add.delay(1, 1).get(timeout=20) == 2
'''


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
         tests: str, mode: str,
         pytest_celery: bool, extra_env: dict[str, str] | None = None,
         ini: str = "celery_ext_app = proj:app", conftest: str = LEFTOVERS,
         ) -> dict[str, list[str]]:
    pytester.makepyfile(proj=PROJECT, conftest=conftest, test_user=tests)
    pytester.makeini(f"[pytest]\n{ini}\n")
    leftovers = tmp_path / f"leftovers-{mode}-{pytest_celery}.json"
    monkeypatch.setenv("LEFTOVERS_FILE", str(leftovers))
    monkeypatch.setenv("PROJ_MODE", mode)
    for key, value in (extra_env or {}).items():
        monkeypatch.setenv(key, value)
    args = ["-p", "celery_ext.pytest", "-p", "no:cacheprovider", "-q"]
    if not pytest_celery:
        args += ["-p", "no:celery"]
    result = pytester.runpytest_subprocess(*args, timeout=200)
    assert result.ret == 0, "\n".join(result.outlines[-60:])
    found: dict[str, list[str]] = json.loads(leftovers.read_text())
    return found


@pytest.mark.parametrize("pytest_celery", [True, False], ids=["pytest-celery", "no-celery"])
@pytest.mark.parametrize("mode", ["dropin", "install"])
def test_plugin_gives_a_user_suite_a_broker_and_worker(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str,
        pytest_celery: bool) -> None:
    found = _run(pytester, monkeypatch, tmp_path, PLUGIN_TESTS, mode, pytest_celery)
    assert found == {"threads": [], "pools": []}


def test_plugin_on_an_existing_server_with_the_pool_and_concurrency_from_ini(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        redis_server: RedisServer) -> None:
    """``CELERY_EXT_TEST_BROKER_URL``: no server started; each test's keys deleted. The
    same run takes the worker's pool and concurrency from the ini (one user suite's
    start-up asserts both)."""
    client = redis_server.client(db=5)
    client.flushdb()
    client.set("user-data", "kept")
    url = redis_server.url(scheme="celery-ext", db=5)
    found = _run(pytester, monkeypatch, tmp_path, PLUGIN_TESTS, "install", False,
                 ini="celery_ext_app = proj:app\ncelery_ext_pool = threads\n"
                     "celery_ext_concurrency = 4",
                 extra_env={"CELERY_EXT_TEST_BROKER_URL": url, "EXPECT_POOL": "thread",
                            "EXPECT_CONCURRENCY": "4"})
    assert found == {"threads": [], "pools": []}
    left = {key.decode() for key in client.scan_iter()}
    assert "user-data" in left
    assert not [key for key in left if key.startswith("{test-")], sorted(left)[:10]


@pytest.mark.parametrize("mode", ["dropin", "install"])
def test_celery_contrib_pytest_fixtures(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        redis_server: RedisServer, mode: str) -> None:
    """Celery's own ``celery_app``/``celery_worker`` fixtures with a celery-ext broker.
    (pytest-celery's plugin replaces Celery's ``celery_worker``: upstream says not to
    mix the two, so this runs with ``-p no:celery``.)"""
    for db in (6, 7):
        redis_server.client(db=db).flushdb()
    found = _run(pytester, monkeypatch, tmp_path, CELERY_CONTRIB_TESTS, mode, False, extra_env={
        "BROKER_URL": redis_server.url(scheme="celery-ext", db=6),
        "BACKEND_URL": redis_server.url(db=7)},
        conftest=LEFTOVERS + '\npytest_plugins = ("celery.contrib.pytest",)\n')
    assert found == {"threads": [], "pools": []}


@pytest.mark.parametrize("mode", ["dropin", "install"])
def test_pytest_celery_without_docker(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path, mode: str) -> None:
    """pytest-celery's ``celery_setup`` on local nodes (broker, backend, a ``celery
    worker`` subprocess of the app under test): no Docker engine."""
    found = _run(pytester, monkeypatch, tmp_path, PYTEST_CELERY_TESTS, mode, True,
                 ini="celery_ext_app = proj:app\ncelery_ext_pool = prefork\n"
                     "celery_ext_concurrency = 2",
                 conftest=LEFTOVERS + "\nfrom celery_ext.testing.pytest_celery import *  # noqa\n")
    assert found == {"threads": [], "pools": []}


def test_a_missing_app_is_one_short_line_per_test(pytester: pytest.Pytester) -> None:
    """Without ``celery_ext_app`` each test errors with a line that says what to set,
    whole in the summary (it was cut there: "pytest.UsageError: celery_ext: name the C...")."""
    pytester.makepyfile(test_user="def test_add(celery_ext_worker):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "celery_ext.pytest", "-p", "no:cacheprovider",
                                           "-p", "no:celery", timeout=120)
    assert result.ret != 0
    result.stdout.fnmatch_lines(
        ["ERROR test_user.py::test_add - Failed: set celery_ext_app (ini or fixture)"])
    assert "Traceback" not in result.stdout.str()
