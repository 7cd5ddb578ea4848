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


def test_the_router_is_asked_once_per_task_however_often_a_worker_start_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's start asks for every task's queue nine times (weights, limits, rate
    limits, fair limits, declared queues): with 10,000 job names each was 10,000 calls of
    Celery's router. The answers are kept per app: one router call per task, and a task
    whose own queue changes, or one bound since, is asked again."""
    from celery_ext.options.fair import job_fair_limits
    from celery_ext.options.limits import job_limits, shared_limits
    from celery_ext.options.rate_limits import job_rate_limits
    from celery_ext.worker.bootsteps import declare_job_queues, job_queues

    app = make(None)
    tasks = [app.task(name=f"many.{i}", shared=False)(body) for i in range(200)]
    asked: list[str] = []
    router = app.amqp.router
    route = router.route

    def counted(options: Any, name: str, *args: Any, **kw: Any) -> Any:
        asked.append(name)
        return route(options, name, *args, **kw)

    monkeypatch.setattr(router, "route", counted)
    for _ in range(3):  # what a worker's start asks, three times over
        job_queues(app)
        declare_job_queues(app)
        job_limits(app)
        shared_limits(app)
        job_rate_limits(app)
        job_fair_limits(app)
    assert len(asked) == len(app.tasks)  # each task once, not once per question
    assert sorted(asked) == sorted(app.tasks)
    assert task_queues(app)["many.7"] == "many.7"

    asked.clear()
    tasks[7].queue = "elsewhere"  # its own queue changed: asked again, answer follows
    app.task(name="many.new", shared=False)(body)  # bound since: asked
    assert task_queues(app)["many.7"] == "elsewhere"
    assert task_queues(app)["many.new"] == "many.new"
    assert sorted(asked) == ["many.7", "many.new"]


def test_binding_tasks_with_no_consumer_running_does_not_walk_the_consumers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery calls ``Task.on_bound`` for every task when an app is finalized: 20,000
    calls at a worker's start with 10,000 job names. With no consumer of the process
    running (every one of them, at a start), none iterates the weak set of consumers."""
    import weakref

    from celery_ext.worker import bootsteps

    iterations = 0

    class Counting(weakref.WeakSet):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            nonlocal iterations
            iterations += 1
            return super().__iter__()

    monkeypatch.setattr(bootsteps, "_running_consumers", Counting())
    app = make(None)
    bootsteps.add_worker_parts(app)
    for i in range(1_000):
        app.task(name=f"bound.{i}", shared=False)(body)
    app.finalize(auto=True)
    assert iterations == 0


def test_shared_limit_lines_without_any_limit_build_no_table_of_every_queue() -> None:
    """The start-up lines about limited queues that other tasks share (``shared_limits``)
    need only the queues some task limits: with 2,000 job names and no limit, it no
    longer builds a table of every queue and its tasks (a dict per queue, sorted: a
    second of a start with 10,000 job names). Counted in bytes allocated at the peak."""
    import tracemalloc

    from celery_ext.options.limits import shared_limits

    n = 2_000
    app = make(None)
    for i in range(n):
        app.task(name=f"unlimited.{i}", shared=False)(body)
    limited = make(None)
    for i in range(3):
        limited.task(name=f"shared.{i}", queue="one", shared=False,
                     max_concurrency=2 if i else None)(body)
    task_queues(app)  # (the router's answers are kept: not what is counted here)
    tracemalloc.start()
    try:
        task_queues(app)  # what it reads: the table of task -> queue (one dict)
        table = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        assert shared_limits(app) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < table + 20 * n  # bytes: a dict per queue alone is > 200 B each
    lines = shared_limits(limited)  # a shared limited queue is still said, as before
    assert len(lines) == 1 and "'one' has max_concurrency=2" in lines[0]
    assert "shared.0 (max_concurrency=None)" in lines[0]


def test_option_passes_read_no_task_queue_when_no_task_sets_the_option() -> None:
    """A worker's start asks, for every task, its limit, fair limit, fair rate and rate
    limit, and which limited queues tasks share (six passes); each read every task's job
    queue first (a pass of its own: 10,000 tasks at 10,000 job names). When no task sets
    the option none is read; a task that sets it (a bad value too) takes the full pass."""
    from celery_ext.options.fair import job_fair_limits, job_fair_rates
    from celery_ext.options.limits import job_limits, shared_limits
    from celery_ext.options.rate_limits import RateLimits, job_rate_limits

    reads = 0
    app = make(None)

    class Counting(app.Task):  # type: ignore[name-defined,misc]
        @property
        def queue(self) -> None:
            nonlocal reads
            reads += 1
            return None

    for i in range(300):
        app.task(name=f"plain.{i}", base=Counting, shared=False)(body)
    app.finalize(auto=True)
    for name in [n for n in app.tasks if not n.startswith(("plain.", "celery."))]:
        app.tasks.unregister(name)  # shared tasks of other test apps (some set limits)
    task_queues(app)  # the router's answers, kept (what a worker's finalize asks)
    reads = 0
    assert job_limits(app) == {} and job_fair_limits(app) == {}
    assert job_fair_rates(app) == {} and job_rate_limits(app) == RateLimits()
    assert shared_limits(app) == [] and shared_limits(app, "fair_max_concurrency") == []
    assert reads == 0  # (before: six passes over the 300 tasks' queues)

    app.task(name="limited", max_concurrency=2, rate_limit="5/s", shared=False)(body)
    assert job_limits(app) == {"limited": 2}
    assert job_rate_limits(app).queues == {"limited": 200_000}
    assert reads > 0
    app.task(name="bad", max_concurrency=0, shared=False)(body)
    with pytest.raises(ValueError, match="max_concurrency=0"):
        job_limits(app)
