"""``apply_many``'s direct path (``producer/bulk_jobs.py``) against a real server: each
job it stores is the message ``apply_async`` stores, field by field and in the same
order (only its ids and timestamps differ), with every option; publish signals are
sent per job with Celery's arguments, the router is asked per job, and unique jobs
hold in every mode.

A spy on ``Jobs.publish`` (the real method runs) proves the direct path was taken."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from kombu.utils.json import dumps

import celery_ext
from celery_ext.producer.bulk_jobs import Jobs
from celery_ext.store.compact import unpack
from celery_ext.store.keys import Keys
from tests.apps import proj, proj_bulk
from tests.helpers import wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
TALLY = "tests.apps.proj_bulk.tally"

#: Fields that differ between two publishes of the same call: ids, and what is read
#: from the clock at publish time (the ETA and expiry dates, ``enqueued_at``).
PER_PUBLISH = {("headers", "id"), ("headers", "root_id"), ("headers", "eta"),
               ("headers", "expires"), ("properties", "correlation_id"),
               ("properties", "delivery_tag"), ("properties", "enqueued_at")}


@pytest.fixture
def direct(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The task names ``Jobs.publish`` built a job of during the test."""
    names: list[str] = []
    real = Jobs.publish

    def publish(self: Jobs, args: Any, kwargs: Any) -> Any:
        names.append(self.name)
        return real(self, args, kwargs)

    monkeypatch.setattr(Jobs, "publish", publish)
    return names


def stored(client: redis.Redis) -> dict[str, str]:
    """Every stored message of db 0 (job queues, the scheduled set's records), by task id,
    as the message it stands for (``store/compact.py``), in Kombu's JSON."""
    found: dict[str, str] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        values: list[bytes] = []
        queue = ""
        if kind == b"list":
            values = client.lrange(key, 0, -1)
            queue = key.decode().removeprefix(K.queue("")).split("\x06")[0]  # (its levels)
        elif kind == b"hash":
            values = list(client.hvals(key))
        for raw in values:
            record = raw.decode("utf-8", "replace")
            text = record.rsplit("\n", 1)[-1]
            if kind == b"hash" and record.count("\n") >= 2:
                queue = record.split("\n", 2)[1]  # "<meta>\n<queue>\n<payload>"
            if text.startswith("{") and '"headers"' in text:
                message = unpack(text, queue)
                found[message["headers"]["id"]] = dumps(message)
    return found


def fields(payload: str) -> list[tuple[Any, ...]]:
    """The message as an ordered list of (section, field, value), the per-publish fields'
    values replaced by whether they are set; the body decoded to its bytes."""
    message = json.loads(payload)
    out: list[tuple[Any, ...]] = []
    for section, value in message.items():
        if isinstance(value, dict):
            for name, v in value.items():
                if (section, name) in PER_PUBLISH:
                    v = v is not None
                if section == "properties" and name == "delivery_info":
                    v = list(v.items())
                out.append((section, name, v))
        elif section == "body":
            out.append((section, base64.b64decode(value)))
        else:
            out.append((section, value))
    return out


def one_each_way(client: redis.Redis, task: Any, args: Any, kwargs: Any,
                 **options: Any) -> tuple[str, str]:
    """Publish one job with ``apply_async`` and one with ``apply_many``: their payloads."""
    single = task.apply_async(args, kwargs, **options)
    [many] = task.apply_many([args or kwargs], **options)
    payloads = stored(client)
    return payloads[single.id], payloads[many.id]


@pytest.fixture
def installed(broker_url: str, redis_client: redis.Redis) -> Iterator[redis.Redis]:
    proj.configure(broker_url)
    yield redis_client


CASES: list[tuple[str, Callable[[], Any], tuple[Any, ...], dict[str, Any], dict[str, Any]]] = [
    ("plain", lambda: proj_bulk.tally, ("m", 1), {}, {}),
    ("kwargs", lambda: proj_bulk.tally, (), {"key": "m", "i": 2}, {}),
    ("priority, headers, expiry, time limits", lambda: proj_bulk.tally, ("m", 3), {},
     {"priority": 9, "headers": {"trace": "t-1"}, "expires": 600, "time_limit": 30,
      "soft_time_limit": 20, "shadow": "shadowed"}),
    ("countdown (scheduled set)", lambda: proj_bulk.tally, ("m", 4), {}, {"countdown": 600}),
    ("eta and a link", lambda: proj_bulk.tally, ("m", 5), {},
     {"eta": datetime.now(UTC) + timedelta(hours=1), "link": proj.add.s(1)}),
    ("fair key", lambda: proj_bulk.tenant_tally, ("m", "tenant-a", 6), {}, {}),
    ("fair key given per call", lambda: proj_bulk.tally, ("m", 7), {}, {"fair_key": "t-b"}),
    ("result backend", lambda: proj.add, (1, 2), {}, {}),
    ("explicit queue", lambda: proj_bulk.tally, ("m", 8), {}, {"queue": "elsewhere"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_job_of_apply_many_is_stored_as_apply_async_stores_it(
        installed: redis.Redis, direct: list[str], case: Any) -> None:
    _, task_of, args, kwargs, options = case
    task = task_of()
    single, many = one_each_way(installed, task, args, kwargs, **options)
    assert direct == [task.name]
    assert fields(many) == fields(single)


def test_unique_jobs_are_stored_alike_and_hold_in_bulk(
        installed: redis.Redis, direct: list[str]) -> None:
    single = proj_bulk.unique_tally.apply_async(("m", "alone"))
    [many] = proj_bulk.unique_tally.apply_many([("m", "other")])
    payloads = stored(installed)
    a, b = json.loads(payloads[single.id]), json.loads(payloads[many.id])
    assert a["headers"].pop("celery_ext_unique") != b["headers"].pop("celery_ext_unique")
    assert list(a["headers"]) == list(b["headers"])
    # Published again, both keys are held: each result names the pending job.
    again = proj_bulk.unique_tally.apply_many([("m", "alone"), ("m", "other"), ("m", "new")])
    assert [r.id for r in again[:2]] == [single.id, many.id]
    assert len(stored(installed)) == 3
    assert direct == ["tests.apps.proj_bulk.unique_tally"] * 4


def test_drop_in_apply_many_stores_what_apply_async_stores(
        broker_url: str, redis_client: redis.Redis, direct: list[str]) -> None:
    """No ``install(app)``: the app's own routes, no unique or option checks."""
    app = Celery("dropin_messages", broker=broker_url, set_as_current=False)
    app.conf.task_routes = {"dropin.m": {"queue": "dropin-q"}}
    app.conf.task_ignore_result = True

    @app.task(name="dropin.m", shared=False)
    def m(i: int) -> None: ...

    try:
        single = m.apply_async((1,), priority=5)
        [many] = celery_ext.apply_many(m, [(1,)], priority=5)
    finally:
        app.close()
    assert direct == ["dropin.m"]
    payloads = stored(redis_client)
    assert fields(payloads[many.id]) == fields(payloads[single.id])


def test_publish_signals_are_sent_per_job_with_celerys_arguments(
        installed: redis.Redis, direct: list[str]) -> None:
    seen: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}

    def recorder(name: str) -> Callable[..., None]:
        def receive(sender: Any = None, signal: Any = None, **kw: Any) -> None:
            kw["properties"] = dict(kw.get("properties") or {})
            kw["headers"] = dict(kw["headers"])
            seen[name].append({"sender": sender, **kw})
        return receive

    on_before, on_after = recorder("before"), recorder("after")
    before_task_publish.connect(on_before, weak=False)
    after_task_publish.connect(on_after, weak=False)
    try:
        single = proj_bulk.tally.apply_async(("s", 0), priority=4)
        many = proj_bulk.tally.apply_many([("s", 1), ("s", 2)], priority=4)
    finally:
        before_task_publish.disconnect(on_before)
        after_task_publish.disconnect(on_after)
    assert direct == [TALLY, TALLY]
    ids = [single.id, *(r.id for r in many)]
    assert [s["headers"]["id"] for s in seen["before"]] == ids
    assert [s["headers"]["id"] for s in seen["after"]] == ids
    for name in ("before", "after"):
        first, *rest = seen[name]
        for other in rest:
            assert sorted(other) == sorted(first)  # the same arguments
            for arg in ("sender", "exchange", "routing_key", "retry_policy"):
                assert other.get(arg) == first.get(arg)
            assert list(other["headers"]) == list(first["headers"])
            if name == "before":
                assert list(other["properties"]) == list(first["properties"])
        assert [tuple(s["body"][0]) for s in seen[name]] == [("s", 0), ("s", 1), ("s", 2)]


def test_a_router_reading_the_arguments_routes_each_job(
        broker_url: str, redis_client: redis.Redis, direct: list[str],
        worker_factory: Callable[..., WorkerProcess], rec: redis.Redis) -> None:
    """A router given args: each job goes where ``apply_async`` would send it."""
    proj.configure(broker_url)
    routes = proj.app.conf.task_routes

    def by_parity(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                  **kw: Any) -> Any:
        if name == TALLY and args and args[1] % 2:
            return {"queue": "odd-jobs"}
        return None

    proj.app.conf.task_routes = [by_parity, *(routes or [])]
    proj.app.amqp.flush_routes()
    proj.app.amqp.__dict__.pop("router", None)
    try:
        results = proj_bulk.tally.apply_many([("route", i) for i in range(10)])
    finally:
        proj.app.conf.task_routes = routes
        proj.app.amqp.flush_routes()
        proj.app.amqp.__dict__.pop("router", None)
    assert len(direct) == 10
    odd = [json.loads(p)["headers"]["id"] for p in redis_client.lrange(K.queue("odd-jobs"), 0, -1)]
    even = [json.loads(p)["headers"]["id"] for p in redis_client.lrange(K.queue(TALLY), 0, -1)]
    assert sorted(odd) == sorted(r.id for r in results[1::2])
    assert sorted(even) == sorted(r.id for r in results[0::2])
    rec.delete("bulk:route")
    worker_factory("tests.apps.proj_bulk", pool="threads", concurrency=4,
                   queues=["odd-jobs", TALLY]).start()
    wait_for(lambda: rec.hlen("bulk:route") >= 10, 60, "the routed jobs to run")
    assert {k.decode(): int(v) for k, v in rec.hgetall("bulk:route").items()} == {
        str(i): 1 for i in range(10)}


def test_unique_jobs_in_every_mode_through_apply_many(
        installed: redis.Redis, direct: list[str], rec: redis.Redis,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """Until started, until finished and debounced: one job per key, each result naming
    the job that is pending, as a loop of ``apply_async`` would leave them."""
    from tests.apps import proj_unique

    rec.delete("runs:ak1", "runs:ak2", "runs:adeb", "runs:ast", "start:ak1", "start:ak2")
    held = proj_unique.held.apply_many([("ak1",), ("ak1",), ("ak2",), ("ak1",)])
    debounced = proj_unique.debounced.apply_many([("adeb", n) for n in (1, 2, 3)])
    started = proj_unique.started.apply_many([("ast",), ("ast",)])
    assert len(direct) == 9
    assert [r.id for r in held] == [held[0].id, held[0].id, held[2].id, held[0].id]
    assert [r.id for r in started] == [started[0].id] * 2
    assert installed.llen(K.queue("tests.apps.proj_unique.held")) == 2
    assert installed.llen(K.queue("tests.apps.proj_unique.started")) == 1
    assert installed.zcard(K.scheduled) == 1  # the debounced job: the latest replaced the others
    assert len({r.id for r in debounced}) == 3
    # The stored unique job is what apply_async stores (its lock's digest aside).
    single = proj_unique.held.apply_async(("ak3",))
    payloads = stored(installed)
    ours, theirs = fields(payloads[held[0].id]), fields(payloads[single.id])
    assert [f for f in ours if f[:2] != ("headers", "celery_ext_unique")
            and f[:2] != ("headers", "argsrepr") and f[0] != "body"] == [
        f for f in theirs if f[:2] != ("headers", "celery_ext_unique")
        and f[:2] != ("headers", "argsrepr") and f[0] != "body"]
    assert ("headers", "celery_ext_unique_mode", "until_finished") in ours
    worker_factory("tests.apps.proj_unique", pool="solo", concurrency=1).start()
    wait_for(lambda: rec.llen("runs:ak1") and rec.llen("runs:ak2") and rec.llen("runs:adeb")
             and rec.llen("runs:ast"), 60, "the jobs to run")
    assert [r.decode().split(":")[1] for r in rec.lrange("start:ak1", 0, -1)] == [held[0].id]
    assert [r.decode().split(":")[1] for r in rec.lrange("start:ak2", 0, -1)] == [held[2].id]
    assert rec.lrange("runs:adeb", 0, -1) == [b"3"]
    assert rec.lrange("runs:ast", 0, -1) == [b"s"]


def test_fair_keys_hold_when_other_receivers_are_connected(
        installed: redis.Redis, direct: list[str]) -> None:
    """With a receiver of the user's, the signal is sent and celery_ext's receiver sets
    the fair key, as for a single publish."""
    seen: list[str] = []

    def on_before(headers: Any = None, **kw: Any) -> None:
        seen.append(headers["id"])

    before_task_publish.connect(on_before, weak=False)
    try:
        results = proj_bulk.tenant_tally.apply_many(
            [("fk", tenant, i) for tenant in "ab" for i in range(2)])
    finally:
        before_task_publish.disconnect(on_before)
    assert seen == [r.id for r in results]
    fair = "tests.apps.proj_bulk.tenant_tally"
    assert installed.llen(K.fair_queue(fair, "a")) == 2
    assert installed.llen(K.fair_queue(fair, "b")) == 2


def test_a_job_publishing_apply_many_is_its_parent(
        installed: redis.Redis, worker_factory: Callable[..., WorkerProcess]) -> None:
    """Inside a worker: each job names the publishing job as its parent and root."""
    parent = proj_bulk.fan_out.delay("fan", 5)
    worker_factory("tests.apps.proj_bulk", pool="threads", concurrency=2,
                   queues=["tests.apps.proj_bulk.fan_out"]).start()
    wait_for(lambda: installed.llen(K.queue(TALLY)) >= 5, 60, "the fan-out to publish")
    headers = [unpack(p, TALLY)["headers"] for p in installed.lrange(K.queue(TALLY), 0, -1)]
    assert {(h["parent_id"], h["root_id"]) for h in headers} == {(parent.id, parent.id)}
    assert sorted(h["argsrepr"] for h in headers) == [f"('fan', {i})" for i in range(5)]


def test_a_task_class_overriding_apply_async_publishes_through_it(
        broker_url: str, redis_client: redis.Redis, direct: list[str]) -> None:
    """What the direct path skips must be Celery's own: a task whose class overrides
    ``apply_async`` gets its ``apply_async`` per job, in one bulk."""
    app = Celery("custom_apply", broker=broker_url, set_as_current=False)
    app.conf.task_ignore_result = True
    celery_ext.install(app)
    calls: list[Any] = []

    class Counted(app.Task):  # type: ignore[name-defined,misc]
        def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
            calls.append(args)
            return super().apply_async(args, kwargs, **options)

    @app.task(name="custom.m", base=Counted, shared=False)
    def m(i: int) -> None: ...

    try:
        results = m.apply_many([(i,) for i in range(3)])
    finally:
        app.close()
    assert direct == [] and calls == [(0,), (1,), (2,)]
    assert len(redis_client.lrange(K.queue("custom.m"), 0, -1)) == 3
    assert len({r.id for r in results}) == 3


def test_a_library_wrapping_apply_async_keeps_its_wrapper(
        installed: redis.Redis, direct: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An APM that wraps Celery's ``Task.apply_async`` in place (``functools.wraps``, as
    tracing libraries do, to add a trace header) runs for each job of ``apply_many``."""
    import functools

    from celery.app import task as celery_task

    original = celery_task.Task.apply_async

    @functools.wraps(original)
    def traced(self: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        options["headers"] = {**(options.get("headers") or {}), "trace": "apm"}
        return original(self, args, kwargs, **options)

    monkeypatch.setattr(celery_task.Task, "apply_async", traced)
    results = proj_bulk.tally.apply_many([("apm", i) for i in range(3)])
    assert direct == []
    payloads = stored(installed)
    assert [json.loads(payloads[r.id])["headers"]["trace"] for r in results] == ["apm"] * 3


@pytest.mark.parametrize("expires", [
    datetime.now(UTC).replace(tzinfo=None) + timedelta(hours=2),  # naive: taken as UTC
    datetime.now(UTC) + timedelta(hours=2),
    (datetime.now(UTC) + timedelta(hours=2)).isoformat()], ids=["naive", "aware", "iso"])
def test_an_expiry_given_as_a_date_is_stored_as_apply_async_stores_it(
        installed: redis.Redis, direct: list[str], expires: Any) -> None:
    """The same ``expires`` header, and a broker ``expiration`` counted at each publish."""
    single, many = one_each_way(installed, proj_bulk.tally, ("x", 1), {}, expires=expires)
    assert direct == [TALLY]
    a, b = json.loads(single), json.loads(many)
    assert a["headers"]["expires"] == b["headers"]["expires"]
    assert abs(int(a["properties"]["expiration"]) - int(b["properties"]["expiration"])) < 5000
    assert [f for f in fields(many) if f[:2] != ("properties", "expiration")] == [
        f for f in fields(single) if f[:2] != ("properties", "expiration")]
