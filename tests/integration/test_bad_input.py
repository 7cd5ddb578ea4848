"""Bad and hostile input (issue 7): garbage in job queues, oversized payloads, a
full or evicting Redis, bad task options and broker URLs, Redis down at start.

Each case runs against a real server; where a worker's behaviour is involved, a
real ``celery worker`` subprocess (``tests.apps.proj`` with ``install(app)``). What every
case must show: one clear line saying what is wrong, no crash loop, nothing
silently dropped, no password in any log line.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

import celery_ext
from celery_ext.client import Client
from celery_ext.config import DEFAULT_MAX_PAYLOAD_BYTES
from celery_ext.errors import BrokerOutOfMemory, PayloadTooLarge
from celery_ext.store.keys import Keys
from celery_ext.testing.server import RedisServer
from tests.apps import proj
from tests.helpers import celery_cli, free_port, only_pool, push, wait_for
from tests.workers import READY_PATTERN, REPO_ROOT, WorkerProcess

#: KILLMARK
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
Factory = Callable[..., WorkerProcess]
QUEUE = "tests.apps.proj.add"
PASSWORD = "S3cret-Pw-4d1e"


def envelope(tag: str, body: bytes | None = None, **changes: Any) -> dict[str, Any]:
    """The Kombu envelope of a valid ``tests.apps.proj.add(1, 2)`` job; ``changes`` replace
    top-level fields (None removes one)."""
    raw = json.dumps([[1, 2], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                   "chord": None}]).encode()
    msg: dict[str, Any] = {
        "body": base64.b64encode(raw if body is None else body).decode(),
        "content-encoding": "utf-8", "content-type": "application/json",
        "headers": {"lang": "py", "task": QUEUE, "id": f"id-{tag}", "retries": 0,
                    "root_id": f"id-{tag}", "parent_id": None, "argsrepr": "(1, 2)",
                    "kwargsrepr": "{}", "origin": "test", "ignore_result": False},
        "properties": {"correlation_id": f"id-{tag}", "reply_to": "", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": QUEUE},
                       "priority": 0, "body_encoding": "base64", "delivery_tag": tag},
    }
    for key, value in changes.items():
        if value is None:
            msg.pop(key, None)
        else:
            msg[key] = value
    return msg


def with_headers(tag: str, **headers: Any) -> str:
    base = envelope(tag)
    return json.dumps({**base, "headers": {**base["headers"], **headers}})


def with_props(tag: str, **props: Any) -> str:
    base = envelope(tag)
    return json.dumps({**base, "properties": {**base["properties"], **props}})


#: name -> (payload pushed into the job queue, dead reason, part of the error).
GARBAGE: dict[str, tuple[bytes | str, str, str]] = {
    "raw bytes": (b"\xff\xfe\x00\x01\x80 binary", "undecodable", "JSONDecodeError"),
    "not JSON": ("hello, not json", "undecodable", "JSONDecodeError"),
    "JSON array": (json.dumps([1, 2, 3]), "undecodable", "is an array, not a JSON object"),
    "JSON null": ("null", "undecodable", "is null, not a JSON object"),
    "no properties": (json.dumps({"body": "x", "headers": {"task": QUEUE}}), "undecodable",
                      "no properties object"),
    "properties a string": (json.dumps({"body": "x", "properties": "p"}), "undecodable",
                            "properties are a string"),
    "no headers": (json.dumps(envelope("g-noheaders", headers=None)), "unknown_message",
                   "no task header"),
    "headers a list": (json.dumps(envelope("g-hlist", headers=[1, 2])), "undecodable",
                       "headers are an array"),
    "pickle content type": (json.dumps(envelope(
        "g-pickle", body=pickle.dumps(([1, 2], {}, {})),
        **{"content-type": "application/x-python-serialize", "content-encoding": "binary"})),
        "invalid", "ContentDisallowed: Refusing to deserialize untrusted content of type pickle"),
    "text/plain content type": (json.dumps(envelope("g-text", **{"content-type": "text/plain"})),
                                "invalid", "untrusted content of type text/plain"),
    "content type forging log lines": (json.dumps(envelope(
        "g-forge", **{"content-type": "text/x\r\nFORGED CRITICAL line\x1b[2J"})),
        "invalid", "untrusted content of type text/x"),
    "content type a number": (json.dumps(envelope("g-ctnum", **{"content-type": 5})),
                              "undecodable", "content-type is a number"),
    "truncated base64": (json.dumps(envelope("g-b64", body=None) | {"body": "eyJ"}),
                         "undecodable", "not valid base64"),
    "unknown body_encoding": (with_props("g-rot13", body_encoding="rot13"), "undecodable",
                              "body_encoding 'rot13' is unknown"),
    "body not JSON": (json.dumps(envelope("g-badjson", body=b"[[1, 2], {")), "undecodable",
                      "DecodeError"),
    "body wrong shape": (json.dumps(envelope("g-shape", body=b'{"a": 1}')), "invalid",
                         "not enough values to unpack"),
    "delivery_info a number": (with_props("g-dinfo", delivery_info=5), "undecodable",
                               "delivery_info is a number"),
    "task name a list": (with_headers("g-tlist", task=[QUEUE]), "invalid", "unhashable"),
    "timelimit not a pair": (with_headers("g-tlimit", timelimit="x"), "invalid",
                             "not enough values to unpack"),
    "expires garbage": (with_headers("g-expires", expires="garbage"), "invalid",
                        "invalid expires value"),
    "eta garbage": (with_headers("g-eta", eta="garbage"), "invalid", "invalid ETA value"),
    "only a task header": (json.dumps(envelope("g-noid", headers={"task": QUEUE})), "invalid",
                           "KeyError"),
    "unregistered task": (with_headers("g-unknown", task="tests.no_such_task"),
                          "unknown_task", "NotRegistered: 'tests.no_such_task'"),
}


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Celery:
    proj.configure(broker_url)
    return proj.app


def match_dead(items: list[dict[str, Any]],
               expected: dict[str, tuple[bytes | str, str, str]]) -> dict[str, dict[str, Any]]:
    """Pair every expected case with a distinct dead job of its reason and error."""
    left = list(items)
    found = {}
    for name, (_, reason, fragment) in expected.items():
        for job in left:
            if job["reason"] == reason and fragment in (job.get("error") or ""):
                found[name] = job
                left.remove(job)
                break
        else:
            raise AssertionError(f"no dead job for {name!r} ({reason}, {fragment!r}) in "
                                 f"{[(j['reason'], j.get('error')) for j in left]}")
    assert not left, f"dead jobs nobody expected: {left}"
    return found


# -- garbage in a job queue ------------------------------------------------------------------


def test_garbage_in_a_job_queue_is_dead_with_its_reason_and_the_worker_keeps_going(
        app: Celery, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """Each malformed job lands in the dead set with its reason and one log line; the
    worker neither stops (a headers list or a truncated base64 body used to stop it
    with "Unrecoverable error", and the reaper would hand the job to the next
    worker) nor restarts its consumer, and good jobs around them run."""
    worker = worker_factory("tests.apps.proj", pool="prefork", concurrency=2).start()
    pool = only_pool(redis_client)
    assert proj.add.delay(1, 1).get(timeout=15) == 2
    for payload, _, _ in GARBAGE.values():
        push(redis_client, QUEUE, payload)
    assert proj.add.delay(2, 3).get(timeout=15) == 5

    client = Client(redis_client)
    page = wait_for(lambda: (p := client.dead(limit=100))["total"] >= len(GARBAGE) and p,
                      15, "every garbage job in the dead set")
    found = match_dead(page["items"], GARBAGE)
    assert found["unregistered task"]["task_id"] == "id-g-unknown"
    assert found["pickle content type"]["id"] == "g-pickle"
    # Every job keeps its payload (a person can look at it, fix it, retry it).
    assert client.dead_job(found["raw bytes"]["id"])["payload"]  # type: ignore[index]
    # As stock Celery does for an unregistered task: its result fails.
    meta = proj.app.backend.get_task_meta("id-g-unknown", cache=False)
    assert meta["status"] == "FAILURE" and type(meta["result"]).__name__ == "NotRegistered"

    assert proj.add.delay(4, 5).get(timeout=15) == 9  # and it keeps going
    assert worker.alive and only_pool(redis_client) == pool
    # Nothing left owned (the last job's ack follows its result by a moment).
    wait_for(lambda: redis_client.hlen(K.inflight(pool)) == 0, 5, "an empty in-flight record")
    assert int(redis_client.hget(K.running, QUEUE) or 0) == 0
    assert redis_client.llen(K.queue(QUEUE)) == 0
    log = worker.log_text()
    assert len(re.findall(READY_PATTERN, log)) == 1, "the consumer restarted"
    assert "Unrecoverable" not in log and "Traceback" not in log, worker.log_tail(80)
    # One line per job: Celery's multi-line dumps of the message are not printed.
    dead_lines = [ln for ln in log.splitlines() if "moved to the dead set" in ln]
    assert len(dead_lines) == len(GARBAGE), dead_lines
    assert "The full contents of the message body" not in log
    assert "\x1b" not in log and not re.search(r"(?m)^FORGED", log)
    assert "maxmemory-policy" not in log  # the session server is noeviction: no warning


def test_garbage_without_install_is_dead_too_and_the_consumer_does_not_restart(
        app: Celery, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """Drop-in mode (only the broker URL changed, no ``install(app)``): a job Celery's
    own handler chokes on is dead-lettered by the transport. Without that, a missing
    ``id`` header (a KeyError, which Kombu's Redis transport counts as a connection
    error) restarted the consumer, which refetched it, in a loop."""
    worker = worker_factory("tests.apps.proj", pool="solo", concurrency=1,
                            env={"CELERY_EXT_NO_INSTALL": "1"}).start()
    cases = {name: GARBAGE[name] for name in ("only a task header", "task name a list",
                                              "headers a list", "raw bytes")}
    for payload, _, _ in cases.values():
        push(redis_client, "celery", payload)
    assert app.send_task(QUEUE, (2, 3), queue="celery").get(timeout=15) == 5
    client = Client(redis_client)
    page = wait_for(lambda: (p := client.dead())["total"] >= len(cases) and p, 10,
                      "the garbage in the dead set")
    match_dead(page["items"], cases)
    assert app.send_task(QUEUE, (4, 5), queue="celery").get(timeout=15) == 9
    log = worker.log_text()
    assert "Connection to broker lost" not in log and "Unrecoverable" not in log, \
        worker.log_tail(60)
    assert len(re.findall(READY_PATTERN, log)) == 1 and worker.alive
    pool = only_pool(redis_client)
    wait_for(lambda: redis_client.hlen(K.inflight(pool)) == 0, 5, "an empty in-flight record")


def _protocol1(tag: str, task_id: str) -> str:
    """A protocol 1 message (task and id in the JSON body, no task header)."""
    body = json.dumps({"task": QUEUE, "id": task_id, "args": [1, 2], "kwargs": {}})
    return json.dumps(envelope(tag, body=body.encode(), headers={"lang": "py"}))


#: name -> payload whose task id or name holds control characters.
FORGERS: dict[str, str] = {
    "newline in the task id": with_headers(
        "f-id", id="f-id\nFORGED [2026-01-01 00:00:00,000: ERROR/MainProcess] id line"),
    "CR LF in the task name": with_headers("f-name", task=QUEUE + "\r\nFORGED name line"),
    "terminal escape in the task id": with_headers("f-esc", id="f-esc\x1b[2J"),
    "line separator in the task name": with_headers("f-sep", task=QUEUE + "\u2028FORGED sep"),
    "newline in a protocol 1 body id": _protocol1("f-p1", "f-p1\nFORGED protocol 1 line"),
}


@pytest.mark.parametrize("mode", ["install", "drop-in"])
def test_control_characters_in_task_id_or_name_never_reach_a_log_line(
        app: Celery, broker_url: str, redis_client: redis.Redis, worker_factory: Factory,
        mode: str) -> None:
    """A task id or name holding a newline, CR, escape or line separator would forge
    log lines (Celery's "Task name[id] received", ours): the transport dead-letters
    such a job before Kombu or Celery see it, and the worker keeps running jobs."""
    env = {"CELERY_EXT_NO_INSTALL": "1"} if mode == "drop-in" else {}
    queue = QUEUE if mode == "install" else "celery"
    worker = worker_factory("tests.apps.proj", pool="prefork", concurrency=2, env=env).start()
    for payload in FORGERS.values():
        push(redis_client, queue, payload)
    assert app.send_task(QUEUE, (2, 3), queue=queue).get(timeout=15) == 5
    client = Client(redis_client)
    page = wait_for(lambda: (p := client.dead())["total"] >= len(FORGERS) and p, 10,
                      "every forger in the dead set")
    assert page["total"] == len(FORGERS)
    assert {j["id"] for j in page["items"]} == {"f-id", "f-name", "f-esc", "f-sep", "f-p1"}
    for job in page["items"]:
        assert job["reason"] == "undecodable", job
        assert "holds control characters" in job["error"], job
        assert client.dead_job(job["id"])["payload"]  # type: ignore[index]
    assert app.send_task(QUEUE, (4, 5), queue=queue).get(timeout=15) == 9
    log = worker.log_text()
    assert not re.search(r"(?m)^FORGED", log), worker.log_tail(60)
    assert "\x1b" not in log and "\u2028" not in log and "\r" not in log
    assert "FORGED" in log  # the values are in the log, escaped: "...\\nFORGED ..."
    assert worker.alive and len(re.findall(READY_PATTERN, log)) == 1
    if mode == "install":  # (one CLI start-up is enough) `dead show` prints them escaped too
        from tests.webutil import run_cli

        shown = run_cli(broker_url, "dead", "show", "f-id").stdout
        assert "FORGED" in shown and not re.search(r"(?m)^FORGED", shown), shown


# -- payload size ------------------------------------------------------------------------------


def test_payload_over_the_limit_is_refused_at_enqueue_and_nothing_is_written(
        app: Celery, redis_client: redis.Redis) -> None:
    from tests.apps import proj_sets

    big = "x" * (DEFAULT_MAX_PAYLOAD_BYTES + 1)
    for send in (lambda: proj.add.delay(big, 1),
                 lambda: proj.add.apply_async((big, 1), countdown=30),
                 lambda: proj_sets.unique_job.delay(big)):
        started = time.monotonic()
        with pytest.raises(PayloadTooLarge) as info:
            send()
        assert time.monotonic() - started < 1.0  # raised at once, not retried
        message = str(info.value)
        assert "\n" not in message and info.value.size > DEFAULT_MAX_PAYLOAD_BYTES
        assert info.value.name in ("tests.apps.proj.add", "tests.apps.proj_sets.unique_job")
        assert f"is {info.value.size:,} bytes" in message
        assert f"over max_payload_bytes ({DEFAULT_MAX_PAYLOAD_BYTES:,})" in message
        assert "CELERY_EXT_MAX_PAYLOAD_BYTES" in message and "nothing was enqueued" in message
    assert isinstance(info.value, ValueError)
    # Nothing anywhere: no job, no scheduled entry, no unique lock left taken.
    assert redis_client.llen(K.queue("tests.apps.proj.add")) == 0
    assert redis_client.llen(K.queue("tests.apps.proj_sets.unique_job")) == 0
    assert redis_client.zcard(K.scheduled) == 0 and redis_client.hlen(K.scheduled_jobs) == 0
    assert not list(redis_client.scan_iter(K.unique("*")))
    # Just below the limit goes through.
    assert proj.add.delay("y" * (DEFAULT_MAX_PAYLOAD_BYTES // 2), 1).id
    assert redis_client.llen(K.queue("tests.apps.proj.add")) == 1


def test_payload_limit_is_a_setting_and_jobs_within_it_run(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    worker_factory("tests.apps.proj", pool="solo", concurrency=1).start()
    limited = Celery("limited", broker=broker_url, backend=proj.backend_url(broker_url),
                     set_as_current=False)
    limited.conf.broker_transport_options = {"max_payload_bytes": 4096}
    try:
        with pytest.raises(PayloadTooLarge, match=r"over max_payload_bytes \(4,096\)"):
            limited.send_task(QUEUE, ("z" * 4096, "z"), queue=QUEUE)
        assert redis_client.llen(K.queue(QUEUE)) == 0
        assert limited.send_task(QUEUE, ("z" * 1000, "z"), queue=QUEUE).get(timeout=15) \
            == "z" * 1001
    finally:
        limited.close()


# -- a full Redis (noeviction) and an evicting one ---------------------------------------------


@pytest.fixture(scope="module")
def small_server() -> Iterator[RedisServer]:
    """A server of its own: these tests fill it up and change its memory policy."""
    with RedisServer() as server:
        yield server


def fill(client: redis.Redis) -> None:
    """Make Redis full: 4 MiB of data, then maxmemory 2 MiB below what it uses. (Filling
    up to the limit is not enough: used memory then hovers around it as client buffers
    shrink, and some writes slip through.)"""
    for n in range(64):
        client.set(f"filler:{n}", b"f" * 65536)
    client.config_set("maxmemory", str(client.info("memory")["used_memory"] - 2 * 2**20))
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("probe", "x")


def test_full_redis_refuses_enqueue_with_one_clear_error_and_loses_nothing(
        small_server: RedisServer, worker_factory: Factory) -> None:
    """maxmemory reached under noeviction: apply_async raises BrokerOutOfMemory (an
    OperationalError) at once, with nothing half-written; jobs enqueued before all
    run once memory is freed."""
    admin = small_server.client()
    admin.flushall()
    admin.config_set("maxmemory-policy", "noeviction")
    url = small_server.url(scheme="celery-ext")
    proj.configure(url)
    before = [proj.record.delay("full", i).id for i in range(3)]
    try:
        fill(admin)
        queued = admin.llen(K.queue("tests.apps.proj.record"))
        # Even a publish retry policy that retries forever, 2 s apart, does not retry it.
        forever = {"retry": True, "retry_policy": {"max_retries": None, "interval_start": 2}}
        for send, what in (
                (lambda: proj.record.apply_async(("full", 99), **forever),
                 "job tests.apps.proj.record was not enqueued"),  # its queue was declared before
                (lambda: proj.record.apply_async(("full", 99), declare=[], **forever),
                 "job tests.apps.proj.record was not enqueued"),
                (lambda: proj.record.apply_async(("full", 99), countdown=30, **forever),
                 "job tests.apps.proj.record was not enqueued"),
                (lambda: proj.add.apply_async((1, 2), **forever),  # a queue never declared
                 "job tests.apps.proj.add was not enqueued")):  # (its binding is written: bind.lua)
            started = time.monotonic()
            with pytest.raises(BrokerOutOfMemory) as info:
                send()
            assert time.monotonic() - started < 1.0  # no publish-retry loop
            message = str(info.value)
            assert "\n" not in message and message.startswith(f"celery_ext: {what}: the broker "
                                                              "is out of memory"), message
            assert "maxmemory" in message and "nothing was written" in message
        assert isinstance(info.value, OperationalError)
        assert admin.llen(K.queue("tests.apps.proj.record")) == queued == 3
        assert admin.zcard(K.scheduled) == 0
    finally:
        for key in admin.scan_iter("filler:*"):
            admin.delete(key)
        admin.config_set("maxmemory", "0")
    # Memory freed: the jobs from before run, and so does a new one; each once.
    after = proj.record.delay("full", 100).id
    worker_factory("tests.apps.proj", broker_url=url, pool="solo", concurrency=1).start()
    runs = small_server.client(db=2)
    wait_for(lambda: runs.llen("runs:full") >= 4, 15, "the four jobs to run")
    time.sleep(0.3)
    assert runs.llen("runs:full") == 4
    results = [proj.app.AsyncResult(i).get(timeout=5) for i in (*before, after)]
    assert results == [0, 1, 2, 100]


def test_worker_starts_on_a_full_redis_and_stays_up_instead_of_a_restart_loop(
        small_server: RedisServer, worker_factory: Factory) -> None:
    """A full Redis is when workers must start and drain it: a new pool's queue
    bindings are written anyway (bind.lua may run at maxmemory), the weights it cannot
    publish cost one warning line, and it consumes as soon as memory is freed."""
    admin = small_server.client()
    admin.flushall()
    admin.config_set("maxmemory-policy", "noeviction")
    url = small_server.url(scheme="celery-ext")
    proj.configure(url)
    try:
        fill(admin)
        worker = worker_factory("tests.apps.proj", broker_url=url, pool="solo",
                                concurrency=1).start()
        time.sleep(2)  # past start-up and a binding refresh
        assert worker.alive
        log = worker.log_text()
        assert "Unrecoverable" not in log and "Traceback" not in log, log
        assert log.count("job queue weights not published") == 1
    finally:
        for key in admin.scan_iter("filler:*"):
            admin.delete(key)
        admin.config_set("maxmemory", "0")
    assert proj.add.delay(2, 3).get(timeout=15) == 5
    assert worker.alive


def test_evicting_memory_policy_is_one_warning_at_worker_start_and_in_status(
        small_server: RedisServer, worker_factory: Factory) -> None:
    admin = small_server.client()
    admin.flushall()
    url = small_server.url(scheme="celery-ext")
    admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        worker = worker_factory("tests.apps.proj", broker_url=url, pool="solo",
                                concurrency=1).start()
        line = worker.wait_for_log(r"(?m)^.*maxmemory-policy.*$", 15).group(0)
        status = celery_cli("-A", "tests.apps.proj", "ext", "status", broker_url=url)
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
    assert "WARNING" in line and "maxmemory-policy is allkeys-lru" in line, line
    assert "set maxmemory-policy noeviction" in line
    time.sleep(0.5)
    assert worker.log_text().count("maxmemory-policy is") == 1
    assert worker.alive  # a warning, not a refusal: the operator decides
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0].startswith(
        "warning: celery_ext: the broker's maxmemory-policy is allkeys-lru"), status.stdout
    # Back to noeviction: no warning.
    quiet = celery_cli("-A", "tests.apps.proj", "ext", "status", "--json", broker_url=url)
    assert json.loads(quiet.stdout)["warnings"] == [], quiet.stdout


# -- bad task options --------------------------------------------------------------------------


def run_worker_once(app: str, env: dict[str, str], timeout: float = 60) -> tuple[int, list[str]]:
    """Run ``celery -A app worker`` to its exit; (exit code, meaningful output lines)."""
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **env}
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "worker", "-P", "solo",
         "--without-mingle", "--without-gossip"],
        cwd=REPO_ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    noise = ("SecurityWarning", "superuser", "absolutely not recommended", "--uid",
             "User information", "_warn_or_raise_security_error")  # running as root
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if ln.strip() and not any(n in ln for n in noise)]
    return proc.returncode, lines


@pytest.mark.parametrize(("options", "needle"), [
    ({"weight": 0}, "has weight=0; weight must be a whole number >= 1"),
    ({"weight": -3}, "has weight=-3"),
    ({"weight": "5"}, "has weight='5'"),
    ({"weight": 2.5}, "has weight=2.5"),
    ({"max_concurrency": 0}, "has max_concurrency=0; it must be a whole number >= 1"),
    ({"max_concurrency": "2"}, "has max_concurrency='2'"),
    ({"unique": True, "unique_ttl": -5}, "has unique_ttl=-5; it must be a number of seconds"),
    ({"stall_after": "soon"}, "has stall_after='soon'; it must be a number of seconds > 0"),
    ({"backoff": "fast"}, "has backoff='fast'"),
    ({"rate_limit": "abc"}, "has rate_limit='abc': 'abc' is not a rate limit like '20/s'"),
    ({"rate_limit": "10/d"}, "has rate_limit='10/d': '10/d' is not a rate limit like '20/s'"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else "")
def test_bad_task_option_stops_the_worker_with_one_line(
        broker_url: str, options: dict[str, Any], needle: str) -> None:
    code, lines = run_worker_once("tests.apps.proj_bad", {
        "CELERY_EXT_BROKER_URL": broker_url, "PROJ_BAD_OPTIONS": json.dumps(options)})
    assert code == 1, lines
    assert lines == [f"celery_ext: task 'tests.apps.proj_bad.configured' {needle}"] or \
        (len(lines) == 1 and needle in lines[0]), lines


@pytest.mark.parametrize("rate_limit", ["abc", "10/d"])
def test_unparseable_rate_limit_stops_a_dropin_worker_with_one_line(
        broker_url: str, rate_limit: str) -> None:
    """Drop-in too: Celery's consumer parses every ``rate_limit`` as it is built, before any
    consumer step of ours; the check runs earlier, at ``worker_init``."""
    code, lines = run_worker_once("tests.apps.proj_bad", {
        "CELERY_EXT_BROKER_URL": broker_url, "CELERY_EXT_NO_INSTALL": "1",
        "PROJ_BAD_OPTIONS": json.dumps({"rate_limit": rate_limit})})
    assert code == 1, lines
    assert lines == [f"celery_ext: task 'tests.apps.proj_bad.configured' has rate_limit="
                     f"{rate_limit!r}: {rate_limit!r} is not a rate limit like '20/s', '10/m' "
                     "or '5/h'"], lines


@pytest.mark.parametrize(("options", "needle"), [
    ({"weight": 0}, "has weight=0; weight must be a whole number >= 1"),
    ({"rate_limit": "abc"}, "has rate_limit='abc': 'abc' is not a rate limit"),
    ({"rate_limit": "10/d"}, "has rate_limit='10/d'"),
    ({"max_concurrency": 0}, "has max_concurrency=0"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else "")
def test_bad_task_option_is_refused_at_apply_async_and_nothing_is_written(
        broker_url: str, redis_client: redis.Redis, options: dict[str, Any],
        needle: str) -> None:
    """A task no worker with the same code would start for: ``apply_async`` of an
    ``install(app)`` producer raises the worker's one line, and writes nothing; the app's
    other tasks publish as before."""
    producer = Celery("bad_option", broker=broker_url, set_as_current=False)
    celery_ext.install(producer)

    @producer.task(name="bad.option", shared=False, **options)  # not given to later apps
    def job() -> None: ...

    @producer.task(name="good.option", shared=False)
    def fine() -> None: ...

    try:
        with pytest.raises(ValueError) as raised:
            job.delay()
        assert str(raised.value) == f"celery_ext: task 'bad.option' {needle}" or \
            str(raised.value).startswith(f"celery_ext: task 'bad.option' {needle}")
        with pytest.raises(ValueError):  # every time, not only the first
            job.apply_async(countdown=5)
        assert fine.delay().id
    finally:
        producer.close()
    assert not redis_client.exists(K.queue("bad.option"), K.scheduled)
    assert redis_client.llen(K.queue("good.option")) == 1


# -- broker URL, password, Redis down at start -------------------------------------------------


@pytest.mark.parametrize(("url", "needle"), [
    (f"celery-ext://:{PASSWORD}@127.0.0.1:notaport/0", "cannot read host:port"),
    (f"celery-ext://:{PASSWORD}@127.0.0.1:99999/0", "cannot read host:port"),
    (f"celery-xt://:{PASSWORD}@127.0.0.1:6379/0",
     "No such transport: celery-xt.  Did you mean celery-ext?"),
    (f"celery_ext://:{PASSWORD}@127.0.0.1:6379/0",  # urlparse reads no scheme in it
     "scheme 'celery_ext' cannot be read (letters, digits, + - . only): ours is celery-ext://"),
    (f"celery-ext://:{PASSWORD}@127.0.0.1:6379/zero", "the db (path) must be a number"),
    ("celery-ext://:p/w@127.0.0.1:6379/0", "cannot read host:port"),  # unescaped "/"
], ids=["port-not-a-number", "port-out-of-range", "scheme-typo", "scheme-underscore",
        "db-not-a-number", "password-with-slash"])
def test_invalid_broker_url_is_one_line_without_the_password(url: str, needle: str) -> None:
    code, lines = run_worker_once("tests.apps.proj", {"CELERY_EXT_BROKER_URL": url}, timeout=30)
    assert code == 1, lines
    assert len(lines) == 1 and lines[0].startswith("celery_ext: broker URL "), lines
    assert needle in lines[0] and ":**@127.0.0.1" in lines[0], lines
    assert PASSWORD not in lines[0] and "p/w" not in lines[0]


def test_an_underscore_scheme_in_a_producer_says_what_to_write() -> None:
    """Kombu reads no scheme in "celery_ext://" and said "No such transport: " (empty)."""
    producer = Celery("underscore", broker=f"celery_ext://:{PASSWORD}@127.0.0.1:1/0",
                      set_as_current=False)
    try:
        with pytest.raises(KeyError) as err:
            producer.send_task("any.task", ())
    finally:
        producer.close()
    assert "cannot be read" in str(err.value) and "celery-ext://" in str(err.value), err.value
    assert PASSWORD not in str(err.value)


def test_redis_down_at_start_retries_one_line_each_then_consumes_when_it_comes_up(
        worker_factory: Factory) -> None:
    """No server on the port yet: the worker says so once per attempt (URL masked)
    and keeps trying; a server started later on that port gets its jobs run. The
    password appears in no line of the worker's log."""
    port = free_port()
    url = f"celery-ext://:{PASSWORD}@127.0.0.1:{port}/0"
    worker = worker_factory("tests.apps.proj", broker_url=url, pool="solo", concurrency=1)
    worker.start(wait_ready=False)
    attempt = rf"(?m)^.*ERROR.*Cannot connect to celery-ext://:\*\*@127\.0\.0\.1:{port}/0: .*$"
    first = worker.wait_for_log(attempt, timeout=30).group(0)
    assert "refused" in first.lower(), first
    with RedisServer(port=port, password=PASSWORD) as server:
        worker.wait_for_log(READY_PATTERN, timeout=40)
        sender = Celery("late", broker=url, backend=proj.backend_url(url), set_as_current=False)
        try:
            assert sender.send_task(QUEUE, (20, 22), queue=QUEUE).get(timeout=15) == 42
        finally:
            sender.close()
        assert only_pool(server.client())
        assert worker.alive
        worker.stop()
    log = worker.log_text()
    assert PASSWORD not in log
    attempts = re.findall(attempt, log)
    # One line per attempt: the error and when it tries again.
    assert attempts and all("**" in a and "Trying again in" in a for a in attempts), attempts
    assert "\nTrying again" not in log
    assert "Traceback" not in log and "Unrecoverable" not in log, worker.log_tail(60)
