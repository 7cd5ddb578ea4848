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

import celery_ext
from celery_ext.producer.bulk_jobs import Jobs
from celery_ext.store.keys import Keys
from tests.apps import proj, proj_bulk
from tests.helpers import wait_for
from tests.workers import WorkerProcess

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
    """Every stored message of db 0 (job queues, the scheduled set's records), by task id."""
    found: dict[str, str] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        values: list[bytes] = []
        if kind == b"list":
            values = client.lrange(key, 0, -1)
        elif kind == b"hash":
            values = list(client.hvals(key))
        for raw in values:
            text = raw.decode("utf-8", "replace").rsplit("\n", 1)[-1]
            if text.startswith("{") and '"headers"' in text:
                found[json.loads(text)["headers"]["id"]] = text
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
