"""``options/routing.task_queue``: the job queue Celery's router gives a task (pure: an app
that never connects). End to end, with real workers, in tests/integration/test_routing.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery
from kombu import Queue

import celery_ext
from celery_ext.options import routing
from celery_ext.options.routing import task_queue, task_queues


def body(*args: Any) -> None:
    """Every test task's body (Celery builds tasks from functions, not lambdas)."""


def make(routes: Any, install: bool = True, **conf: Any) -> Celery:
    app = Celery("routing_unit", broker="celery-ext://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(task_routes=routes, **conf)
    if install:
        celery_ext.install(app)
    return app


def test_every_form_of_route_and_the_order_celery_gives_them() -> None:
    def by_function(name: str, *args: Any, **kw: Any) -> Any:
        return {"queue": Queue("from_function")} if name == "f" else None

    app = make([{"d": {"queue": "from_dict"}, "glob.*": "from_glob"}, by_function])
    for name, queue in [("d", None), ("glob.x", None), ("f", None), ("own", "own_q"),
                        ("plain", None)]:
        app.task(name=name, queue=queue, shared=False)(body)
    mine = {"d", "glob.x", "f", "own", "plain"}  # (shared tasks of other test apps too)
    assert {k: v for k, v in task_queues(app).items() if k in mine} == {
        "d": "from_dict", "glob.x": "from_glob", "f": "from_function",
        "own": "own_q",  # queue= on the task wins over every route, as in send_task
        "plain": "plain",  # install(app)'s router, last
    }


def test_dropin_tasks_without_routes_are_on_the_default_queue() -> None:
    app = make(None, install=False, task_default_queue="jobs")
    task = app.task(name="t", shared=False)(body)
    assert task_queue(app, task) == "jobs"


def test_a_router_that_needs_arguments_is_asked_with_none_and_a_raise_is_one_line(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def by_argument(name: str, args: Any, kwargs: Any, *rest: Any, **kw: Any) -> Any:
        return {"queue": f"tenant-{args[0]}"}

    app = make([by_argument])
    task = app.task(name="per_tenant", shared=False)(body)
    # Asked once first: shared tasks of other test apps in this process (bench.job_*) are
    # registered on every app, and the app's first use (its finalize and amqp set-up)
    # asks the router about each of them.
    task_queue(app, task)
    monkeypatch.setattr(routing, "_warned", False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "celery_ext.options.routing"):
        assert task_queue(app, task) == "celery"
        assert task_queue(app, task) == "celery"
    assert [r.getMessage() for r in caplog.records] == [
        "celery_ext: task_routes raised IndexError for task per_tenant without arguments; "
        "its options and consumed queue are those of celery (and so for any other task it "
        "raises for)"]
