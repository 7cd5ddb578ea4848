"""A job in flight keeps its queued index entry (issue 36, "fetch cost flat").

The fetch no longer writes the job index: the queued entry carries the job's delivery
tag, and the pool's in-flight record under that tag says the job is in flight
(``store/lua/include/job_index.lua``). These tests run the real scripts on the real
server, with jobs from the real producer: the fetch leaves the entry's bytes as they
were; the readers (``lookup``, the status, stop requests, revoke) find the job in flight
in its pool; every script that moves a job in flight (ack, requeue, recover, dead,
throttle) accepts the queued form and, during a rolling upgrade, the ``inflight`` form
a worker of the previous version wrote; neither form lets the move of one copy
overwrite the entry of another; and the tag a fetch records differs from the entry's
only in ways the readers handle (a duplicate's ``~<n>``, an untagged payload's
``untagged-<sha1>``).

Each test with the ``form`` parameter puts the entry, after the fetch, in the form it
is testing: "queued" rewrites the bytes the enqueue wrote (what the fetch leaves now;
on the code before this change it undoes the fetch's write, so these tests fail there),
"inflight" writes the previous version's entry by hand.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import redis

from celery_ext.admin.job_status import JobLookup
from celery_ext.config import Settings
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.job_index import IndexEntry, lookup
from celery_ext.store.keys import Keys
from celery_ext.store.revoked import revoke
from celery_ext.store.scripts import Scripts
from celery_ext.store.stop_requests import request_stop
from celery_ext.transport.fetch import fetch_call
from celery_ext.worker.heartbeater import Heartbeater
from celery_ext.worker.inflight import InflightRecord, recover_tags
from tests.apps import proj

K = Keys("celery_ext")
QUEUE = "tests.apps.proj.noop"
FORMS = ("queued", "inflight")
TTL_MS = 3_600_000


@pytest.fixture
def settings(broker_url: str, redis_client: redis.Redis) -> Settings:
    proj.configure(broker_url)
    return Settings()


def register(client: redis.Redis, settings: Settings, name: str = "host:1:idx") -> str:
    pool = Heartbeater(client, settings, name)
    pool.register()
    return pool.pool_id


def fetch(client: redis.Redis, settings: Settings, pool: str, n: int = 1) -> list[str]:
    """The tags of up to ``n`` jobs of QUEUE fetched into ``pool`` by ``fetch.lua``."""
    keys, args = fetch_call(K, settings, pool, [QUEUE] * n, "1" * n)
    status, jobs, *_ = Scripts(client)("fetch", keys, args)
    assert status == 1
    return [job[1].decode() for job in jobs]


def raw(client: redis.Redis, task_id: str) -> bytes:
    value = client.hget(K.job_index, task_id)
    assert value is not None
    return value


def payload_tag(payload: bytes) -> str:
    """The delivery tag in a stored payload (the last one, as delivery_tag.lua reads it)."""
    marker = b'"delivery_tag": "'
    start = payload.rindex(marker) + len(marker)
    return payload[start:payload.index(b'"', start)].decode()


def put_form(client: redis.Redis, task_id: str, form: str, queued: bytes, tag: str,
             pool: str) -> None:
    """The entry of a job in flight as ``form`` has it (see the module's docstring)."""
    if form == "queued":
        client.hset(K.job_index, task_id, queued)
    else:
        client.hset(K.job_index, task_id, f"inflight\n1\n{QUEUE}\n{tag}\n{pool}")


def in_flight(client: redis.Redis, task_id: str, tag: str, pool: str) -> IndexEntry:
    entry = lookup(client, K, task_id)
    assert entry is not None and (entry["state"], entry["ref"], entry["detail"],
                                  entry["queue"]) == ("inflight", tag, pool, QUEUE), entry
    return entry


def sent(client: redis.Redis) -> tuple[str, bytes, str]:
    """One job enqueued by the producer: its id, its entry's bytes, its tag."""
    task_id = proj.noop.apply_async().id
    payload = client.lindex(K.queue(QUEUE), 0)
    assert payload is not None
    return task_id, raw(client, task_id), payload_tag(payload)


def test_the_fetch_leaves_the_entry_and_every_reader_finds_the_job_in_its_pool(
        redis_client: redis.Redis, settings: Settings) -> None:
    pool = register(redis_client, settings)
    task_id, before, tag = sent(redis_client)
    state, _ms, queue, level, detail = before.decode().split("\n")
    assert (state, queue, level, detail) == ("queued", QUEUE, "0", tag)
    look = JobLookup(redis_client, settings, proj.app)
    assert look.status(task_id)["state"] == "queued"
    assert not request_stop(redis_client, settings, task_id)  # queued: not in flight

    assert fetch(redis_client, settings, pool) == [tag]
    assert raw(redis_client, task_id) == before  # the fetch wrote nothing to the index
    in_flight(redis_client, task_id, tag, pool)
    st = look.status(task_id)
    assert (st["state"], st["pool"], st["queue"], st["indexed"]) == (
        "reserved", pool, QUEUE, True)
    assert st["job_name"] == proj.noop.name
    assert request_stop(redis_client, settings, task_id)

    record = InflightRecord(redis_client, K, pool, index_ttl=TTL_MS)
    assert record.ack([tag]) == 1
    entry = lookup(redis_client, K, task_id)
    assert entry and (entry["state"], entry["ref"], entry["detail"]) == ("done", tag, pool)
    st = look.status(task_id)  # (no outcome in the backend: acked by hand)
    assert (st["state"], st["pool"]) == ("finished", pool)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("move", ["ack", "requeue", "recover", "dead", "throttle"])
def test_every_move_of_a_job_in_flight_accepts_either_form_of_its_entry(
        redis_client: redis.Redis, settings: Settings, form: str, move: str) -> None:
    pool = register(redis_client, settings)
    task_id, queued, tag = sent(redis_client)
    assert fetch(redis_client, settings, pool) == [tag]
    put_form(redis_client, task_id, form, queued, tag, pool)
    in_flight(redis_client, task_id, tag, pool)
    record = InflightRecord(redis_client, K, pool, settings.priority_steps, TTL_MS)

    if move == "ack":
        assert record.ack([tag]) == 1
        want = ("done", tag, pool)
    elif move == "requeue":
        assert record.requeue([tag]) == [tag]
        want = ("queued", "0", tag)
    elif move == "recover":
        _, requeued, _ = recover_tags(redis_client, settings, pool, [tag], mode="job")
        assert requeued == [tag]
        want = ("queued", "0", tag)
    elif move == "dead":
        assert dead_letter(redis_client, settings, pool, tag, reason="failed", error="E: no")
        want = ("dead", tag, "failed")
    else:
        assert record.throttle(tag, 1_000_000) == "queue"
        want = ("queued", "0", tag)
    entry = lookup(redis_client, K, task_id)
    assert entry and (entry["state"], entry["ref"], entry["detail"]) == want, entry
    if want[0] == "queued":  # back in its queue, under the tag its next fetch records
        redis_client.hdel(K.rate_tat, QUEUE)  # (a throttle's hold)
        assert fetch(redis_client, settings, pool) == [tag]
        in_flight(redis_client, task_id, tag, pool)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("move", ["ack", "requeue", "recover", "dead"])
def test_a_retry_scheduled_before_the_ack_keeps_its_entry_in_either_form(
        redis_client: redis.Redis, settings: Settings, form: str, move: str) -> None:
    """Celery schedules a retry under the same task id before the failed run is acked:
    the move of the failed run leaves the retry's entry alone."""
    pool = register(redis_client, settings)
    task_id, queued, tag = sent(redis_client)
    assert fetch(redis_client, settings, pool) == [tag]
    put_form(redis_client, task_id, form, queued, tag, pool)
    proj.noop.apply_async(task_id=task_id, countdown=60)  # the retry, scheduled
    retry = lookup(redis_client, K, task_id)
    assert retry and retry["state"] == "scheduled"
    record = InflightRecord(redis_client, K, pool, settings.priority_steps, TTL_MS)
    if move == "ack":
        assert record.ack([tag]) == 1
    elif move == "requeue":
        assert record.requeue([tag]) == [tag]
    elif move == "recover":
        assert recover_tags(redis_client, settings, pool, [tag], mode="job")[1] == [tag]
    else:
        assert dead_letter(redis_client, settings, pool, tag, reason="failed")
    assert lookup(redis_client, K, task_id) == retry


@pytest.mark.parametrize("form", FORMS)
def test_a_revoke_reports_a_job_in_flight_and_leaves_it_where_it_is(
        redis_client: redis.Redis, settings: Settings, form: str) -> None:
    """revoke.lua finds a job in flight through its queued entry (or the previous
    version's inflight one): it is reported in flight and asked to stop, not looked for
    in its queue, not moved to the dead set; the revoke holds for its next fetch."""
    pool = register(redis_client, settings)
    task_id, queued, tag = sent(redis_client)
    other_id, _, other_tag = sent(redis_client)  # queued behind it: moved at once
    assert fetch(redis_client, settings, pool) == [tag]
    put_form(redis_client, task_id, form, queued, tag, pool)
    outcome = revoke(redis_client, Scripts(redis_client), settings, [task_id, other_id],
                     by="test", via="cancel", terminate=True)
    assert outcome["inflight"] == [task_id] and outcome["queued"] == []
    assert outcome["removed"] == {other_id: "queued"}
    assert outcome["stop_requested"] == [task_id]
    assert redis_client.hexists(K.inflight(pool), tag)  # still the pool's
    assert not redis_client.hexists(K.dead_jobs, tag)
    in_flight(redis_client, task_id, tag, pool)
    assert redis_client.hexists(K.dead_jobs, other_tag)
    assert JobLookup(redis_client, settings).status(task_id)["stop_requested"]
    # Requeued (its pool stops), the job is dropped as revoked by the fetch that pops it.
    record = InflightRecord(redis_client, K, pool, settings.priority_steps, TTL_MS)
    assert record.requeue([tag]) == [tag]
    assert fetch(redis_client, settings, pool) == []
    entry = lookup(redis_client, K, task_id)
    assert entry and (entry["state"], entry["detail"]) == ("dead", "revoked")


def test_a_duplicate_fetched_under_a_suffixed_tag_is_not_the_copy_the_entry_follows(
        redis_client: redis.Redis, settings: Settings) -> None:
    """Two copies of one message (same task id and delivery tag) in one pool: the fetch
    records the second under "<tag>~1". The entry follows the copy under the payload's
    tag: in flight while that copy is, done when it is acked; the duplicate's ack leaves
    it alone (the copy it follows may still run, or be queued again)."""
    pool = register(redis_client, settings)
    task_id, _, tag = sent(redis_client)
    payload = redis_client.lindex(K.queue(QUEUE), 0)
    assert payload is not None
    enqueue(redis_client, payload)  # a second copy, byte for byte
    assert fetch(redis_client, settings, pool, 2) == [tag, f"{tag}~1"]
    assert raw(redis_client, task_id).split(b"\n")[4] == tag.encode()
    record = InflightRecord(redis_client, K, pool, index_ttl=TTL_MS)
    in_flight(redis_client, task_id, tag, pool)
    assert record.ack([f"{tag}~1"]) == 1
    in_flight(redis_client, task_id, tag, pool)
    assert record.ack([tag]) == 1
    entry = lookup(redis_client, K, task_id)
    assert entry and (entry["state"], entry["ref"], entry["detail"]) == ("done", tag, pool)


def test_a_payload_without_a_tag_is_found_under_the_tag_its_fetch_records(
        redis_client: redis.Redis, settings: Settings) -> None:
    """Another client's layout, no delivery tag: the enqueue's entry and the fetch both
    name it "untagged-<sha1 of its length and ends>", so it is found in flight."""
    pool = register(redis_client, settings)
    task_id = "id-untagged"
    payload = json.dumps({"body": "e30=", "headers": {"id": task_id, "task": QUEUE},
                          "properties": {"correlation_id": task_id}}).encode()
    enqueue(redis_client, payload)
    text = payload.decode()
    tag = "untagged-" + hashlib.sha1(
        f"{len(payload)}\n{text[:512]}\n{text[-512:]}".encode()).hexdigest()
    before = raw(redis_client, task_id)
    assert before.split(b"\n")[4] == tag.encode()
    assert fetch(redis_client, settings, pool) == [tag]
    assert raw(redis_client, task_id) == before
    in_flight(redis_client, task_id, tag, pool)
    assert InflightRecord(redis_client, K, pool, index_ttl=TTL_MS).ack([tag]) == 1
    assert (lookup(redis_client, K, task_id) or {}).get("state") == "done"


def enqueue(client: redis.Redis, payload: bytes) -> Any:
    """``payload`` pushed onto QUEUE by ``enqueue.lua``, its index entry written."""
    return Scripts(client)("enqueue", [K.queue(QUEUE), K.ready, K.queues, K.job_index,
                                       K.job_index_done],
                           [payload, QUEUE, K.wake_channel, 0, TTL_MS])
