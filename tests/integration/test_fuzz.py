"""Fuzzing the job queues: random bytes and random JSON pushed straight into them.

A live ``celery worker`` (prefork) consumes while a few hundred random payloads are
enqueued as a producer would (the ``enqueue`` script: push, ready set, wake-up):
raw bytes, arbitrary JSON, and JSON that looks like a Kombu envelope with random
field values (headers, properties, encodings, delivery tags that collide). None of
them names a registered task, so none may run: each must end in the dead set,
exactly once, byte for byte, while the worker stays up, never restarts its
consumer, and keeps running good jobs sent between and after them.

The seed is random per run and printed on failure; ``CELERY_EXT_FUZZ_SEED=<n>``
replays one.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import string
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import pytest
import redis

from celery_ext.admin.web import create_app
from celery_ext.admin.web.app import PAGE_MAX
from celery_ext.client import Client
from celery_ext.store.keys import Keys
from tests.apps import proj
from tests.helpers import celery_cli, only_pool, push, wait_for
from tests.workers import READY_PATTERN, WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
Factory = Callable[..., WorkerProcess]
QUEUES = ("tests.apps.proj.add", "tests.apps.proj.noop")
#: Few distinct tags, so fuzz messages collide with each other in flight and dead.
TAGS = ("", "a", "dup", "dup", "x y", '"q"')


def random_text(rng: random.Random, size: int = 12) -> str:
    alphabet = string.printable + "éü€\u2028\x00{}[]\"\\"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, size)))


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randint(0, 7 if depth < 3 else 4)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1, 2**53, rng.randint(-10**9, 10**9), rng.random() * 1e6])
    if kind in (3, 4):
        return random_text(rng)
    if kind in (5, 6):
        return {random_text(rng, 6): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def maybe(rng: random.Random, value: Any, chance: float = 0.7) -> Any:
    """``value`` most of the time, else random JSON in its place."""
    return value if rng.random() < chance else random_json(rng)


def random_envelope(rng: random.Random) -> dict[str, Any]:
    """JSON shaped like a Kombu envelope, every field possibly wrong, never a runnable
    job: the task name is unregistered, missing or not a string."""
    body_raw = rng.choice([json.dumps([[1], {}, {}]).encode(),
                           json.dumps(random_json(rng)).encode(),
                           bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))])
    body = rng.choice([base64.b64encode(body_raw).decode(), body_raw.decode("latin-1"),
                       base64.b64encode(body_raw).decode()[:-1], random_text(rng)])
    headers: dict[str, Any] = {
        "task": rng.choice([f"tests.apps.proj.fuzz_{rng.randint(0, 99)}", random_json(rng)]),
        "id": maybe(rng, str(uuid.uuid4())),
    }
    for name in rng.sample(["eta", "expires", "retries", "timelimit", "argsrepr", "root_id",
                            "parent_id", "group", "lang", "shadow", "origin", "ignore_result",
                            "delivery_tag", "stamped_headers", "celery_ext_unique"],
                           rng.randint(0, 6)):
        headers[name] = random_json(rng)
    if rng.random() < 0.1:
        del headers["task"]
    props: dict[str, Any] = {
        "delivery_tag": rng.choice([*TAGS, str(uuid.uuid4())]),
        "body_encoding": rng.choice(["base64", "base64", "utf-8", None, "rot13", 5]),
        "delivery_info": maybe(rng, {"exchange": "", "routing_key": rng.choice(QUEUES)}),
        "priority": maybe(rng, 0),
    }
    msg: dict[str, Any] = {
        "body": maybe(rng, body, 0.9),
        "content-encoding": maybe(rng, rng.choice(["utf-8", "binary", "latin-1"])),
        "content-type": maybe(rng, rng.choice(["application/json", "application/json",
                                               "application/x-python-serialize",
                                               "text/plain", "application/x-yaml"])),
        "headers": maybe(rng, headers, 0.9),
        "properties": maybe(rng, props, 0.9),
    }
    for name in rng.sample(list(msg), rng.randint(0, 1)):
        del msg[name]
    return msg


def fuzz_payloads(rng: random.Random, n: int) -> list[bytes]:
    out: list[bytes] = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            size = rng.choice([0, 1, 2, 7, 30, 200])
            out.append(bytes(rng.getrandbits(8) for _ in range(size)))
        elif kind == 1:
            out.append(json.dumps(random_json(rng)).encode())
        else:
            # Kombu's separators (", " and ": "), as fetch reads the delivery tag by them.
            out.append(json.dumps(random_envelope(rng)).encode())
    return out


def dead_payloads(client: redis.Redis) -> list[bytes]:
    """Payload bytes of every dead job (records are "<meta>\\n<queue>\\n<payload>")."""
    return [raw.split(b"\n", 2)[2] for raw in client.hvals(K.dead_jobs)]


def test_random_bytes_and_json_in_job_queues_all_end_in_the_dead_set(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    seed = int(os.environ.get("CELERY_EXT_FUZZ_SEED") or time.time_ns() % 2**32)
    rng = random.Random(seed)
    why = f"(replay with CELERY_EXT_FUZZ_SEED={seed})"
    proj.configure(broker_url)
    worker = worker_factory("tests.apps.proj", pool="prefork", concurrency=2).start()
    pool = only_pool(redis_client)

    payloads = fuzz_payloads(rng, 330)
    good = []
    for i, payload in enumerate(payloads):
        push(redis_client, QUEUES[i % 2], payload)
        if i % 60 == 30:
            good.append((proj.add.delay(i, 1), i + 1))  # real jobs among the garbage
    for result, expected in good:
        assert result.get(timeout=30) == expected, why

    client = Client(redis_client)
    wait_for(lambda: client.counts()["dead"] >= len(payloads), 60,
               f"{len(payloads)} dead jobs {why}", step=0.1)
    time.sleep(0.5)  # nothing more may arrive
    assert client.counts()["dead"] == len(payloads), why
    assert Counter(dead_payloads(redis_client)) == Counter(payloads), why
    # The client (dashboard, CLI) lists and shows every one of them, whatever is inside.
    items = client.dead(limit=1000)["items"]
    reasons = Counter(j["reason"] for j in items)
    assert set(reasons) <= {"undecodable", "invalid", "unknown_task", "unknown_message"}, \
        (reasons, why)
    assert all(client.dead_job(j["id"]) for j in items), why
    with warnings.catch_warnings():  # Starlette would rather use httpx2; httpx still works
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    with TestClient(create_app(client, sample_interval=5)) as web:
        pages = [web.get("/api/dead", params={"offset": o, "limit": PAGE_MAX})
                 for o in range(0, len(payloads), PAGE_MAX)]
        assert all(p.status_code == 200 for p in pages), why
        assert sum(len(p.json()["items"]) for p in pages) == len(payloads), why
        for job in items[::7]:  # ids come from the messages: "/" and newlines included
            shown = web.get(f"/api/dead/{quote(job['id'], safe='')}")
            assert shown.status_code == 200 and shown.json()["id"] == job["id"], (job["id"], why)
            page = web.get(f"/dead/{quote(job['id'], safe='')}")
            assert page.status_code == 200, (job["id"], why)
    # And the CLI: one row per dead job, nothing a terminal would act on.
    listing = celery_cli("-A", "tests.apps.proj", "ext", "dead", "ls", "--limit", "1000",
                         broker_url=broker_url)
    assert listing.returncode == 0, (listing.stderr, why)
    rows = listing.stdout.splitlines()
    assert len(rows) == 1 + len(payloads), (len(rows), why)
    assert all(row.isprintable() for row in rows), why

    assert proj.add.delay(40, 2).get(timeout=15) == 42, why  # and it still runs jobs
    wait_for(lambda: redis_client.hlen(K.inflight(pool)) == 0, 5,
               f"an empty in-flight record {why}")
    assert all(int(v) == 0 for v in redis_client.hvals(K.running)), why
    assert all(redis_client.llen(K.queue(q)) == 0 for q in QUEUES), why
    assert worker.alive and only_pool(redis_client) == pool, why
    log = worker.log_text()
    assert len(re.findall(READY_PATTERN, log)) == 1, f"the consumer restarted {why}"
    assert "Unrecoverable" not in log and "Traceback" not in log, (worker.log_tail(60), why)


def test_a_forged_message_with_a_live_jobs_delivery_tag_does_not_take_its_place(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory,
        rec: redis.Redis) -> None:
    """A message carrying the delivery tag of a job that is running (or a second copy
    of one) used to overwrite that job's in-flight record: the running job was no
    longer owned, and the forged one vanished when the real job was acked. Now it
    gets its own tag, and both are accounted for."""
    proj.configure(broker_url)
    worker_factory("tests.apps.proj", pool="threads", concurrency=2).start()
    pool = only_pool(redis_client)
    running = proj.record.delay("forged", "done", sleep=1.5)
    tag = wait_for(lambda: redis_client.hkeys(K.inflight(pool)), 10, "the job in flight")[0]
    forged = json.dumps({"body": "", "headers": [], "properties": {"delivery_tag": tag.decode()}})
    for payload in (forged, forged, json.dumps({"properties": {"delivery_tag": "dup"}}),
                    json.dumps({"properties": {"delivery_tag": "dup"}})):
        push(redis_client, "tests.apps.proj.record", payload)
    client = Client(redis_client)
    wait_for(lambda: client.counts()["dead"] == 4, 10, "four dead jobs")
    # The real job is still owned while it runs, then finishes and is acked.
    assert redis_client.hget(K.inflight(pool), tag) is not None
    assert running.get(timeout=10) == "done"
    assert rec.llen("runs:forged") == 1
    wait_for(lambda: redis_client.hlen(K.inflight(pool)) == 0, 5, "an empty in-flight record")
    ids = sorted(j["id"] for j in client.dead()["items"])
    assert len(set(ids)) == 4 and "dup" in ids and "dup~1" in ids, ids
    assert Counter(dead_payloads(redis_client)) == Counter(
        [forged.encode()] * 2 + [json.dumps({"properties": {"delivery_tag": "dup"}}).encode()] * 2)
    assert int(redis_client.hget(K.running, "tests.apps.proj.record") or 0) == 0
