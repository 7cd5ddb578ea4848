"""Revoked task ids: a revoke is state in Redis, not in the memory of the workers up.

    {ns}:revoked      zset   task id -> Redis ms when its revoke lapses (``revoked_ttl``)
    {ns}:revoked_by   hash   task id -> the revoke's meta JSON: reason "revoked", who
                             (``by``), when (``revoked_at``), ``terminate``

Celery keeps revoked ids in each worker's memory and hands them to workers that start
later (mingle): a revoke sent while no worker runs is lost, and a job queued behind
others runs anyway. Here a revoke (:func:`revoke`, from Celery's ``revoke`` broadcast as
the transport publishes it, or from ``Client.cancel``) is one ``revoke.lua`` call per
copy of the layout:

* the id is recorded, and every fetch checks the jobs it pops against it
  (``fetch.lua``): a job with a revoked id, enqueued before or after the revoke,
  promoted from the scheduled or retry set, or returned by a reaper, goes to the dead
  set with reason ``revoked`` instead of running;
* a job the job index finds queued, scheduled or retrying moves to the dead set at
  once, its unique lock released and its cursor dropped (a queued one is looked for in
  its priority level's list: ``revoke.lua`` says the cost);
* a job in flight is reported: with ``terminate``, it gets a stop request (its next
  checkin answers "stop"; Celery's own terminate reaches its worker through the
  broadcast).

On a cluster a fetch touches its job queue's copy only, so the id is written to every
copy (``copies``: the home copy and every known job queue's), one script per copy, in
one pipeline per master, the home copy first. A job queue first seen after the revoke
gets the home's revokes when a pool joins its copy, before its first fetch there
(:func:`copy_revokes`).

A person who retries a revoked job from the dead set lifts its revoke first (:func:`lift`),
so the retried job runs.

Bounded: a revoke lapses ``revoked_ttl`` seconds after it was made, and a copy keeps at
most ``revoked_max`` ids (Celery's ``REVOKE_EXPIRES`` and ``REVOKES_MAX``); each revoke
drops up to 100 lapsed ids and 100 over the cap, and both keys of a copy expire when its
last revoke lapses (a copy no later revoke visits goes whole).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any, TypedDict

from kombu.utils.encoding import bytes_to_str

from celery_ext.config import REVOKE_SCAN_MAX, Settings
from celery_ext.store.clock import now_ms
from celery_ext.store.compact import headers_of
from celery_ext.store.copies import copies, per_copy, run_scripts
from celery_ext.store.job_index import index_ttl_ms
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.store.stop_requests import request_stop


class RevokeOutcome(TypedDict):
    """What one revoke did, by task id."""

    #: Moved to the dead set: id -> "queued" (out of its job queue), "scheduled" or
    #: "retry".
    removed: dict[str, str]
    #: Queued now but not found in the list its index entry names (a fair key's
    #: sub-queue): dropped, to the dead set, by the fetch that pops it.
    queued: list[str]
    #: In flight now (reserved or running).
    inflight: list[str]
    #: In flight and asked to stop at their next checkin (``terminate``).
    stop_requested: list[str]


class RevokedId(TypedDict):
    task_id: str
    lapses_at: float  # Redis-clock seconds
    meta: dict[str, Any]


def sender() -> str:
    """Who revokes, as the records say it: this process's host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def revoke(client: Any, scripts: Scripts, settings: Settings, task_ids: Iterable[str], *,
           by: str, via: str, terminate: bool = False) -> RevokeOutcome:
    """Revoke ``task_ids`` (see the module's docstring); ``by``: who, ``via``: how
    (``"celery control"``, ``"cancel"``), both kept in the records."""
    ids = sorted({str(i) for i in task_ids if i})
    outcome = RevokeOutcome(removed={}, queued=[], inflight=[], stop_requested=[])
    if not ids:
        return outcome
    keys = Keys.for_settings(settings)
    meta = json.dumps({"reason": "revoked", "error": f"revoked by {by} ({via})", "by": by,
                       "via": via, "terminate": bool(terminate)}, separators=(",", ":"))
    args = [meta, int(settings.revoked_ttl * 1000), settings.revoked_max,
            settings.dead_max_size, int(settings.dead_max_age * 1000), index_ttl_ms(settings)]

    def call(copy: Keys) -> tuple[str, list[str], list[Any]]:
        return ("revoke", [copy.revoked, copy.revoked_by, copy.job_index, copy.job_index_done,
                           copy.dead, copy.dead_jobs, copy.scheduled, copy.retry,
                           copy.scheduled_jobs, copy.redelivery, copy.inflight_pools],
                [*args, copy.queue(""), copy.unique(""), copy.cursor_prefix,
                 REVOKE_SCAN_MAX, copy.inflight(""), *ids])

    # The home copy first, then the known job queues read: a pool that joins a queue's
    # copy registers the queue before it copies the home's revokes (copy_revokes), so
    # the copy gets this revoke from one side or the other.
    replies = run_scripts(client, scripts, [call(keys.home)])
    if keys.cluster:
        replies += run_scripts(client, scripts, [call(copy) for copy in copies(client, keys)
                                                 if copy != keys.home])
    for moved, inflight, queued in replies:
        moved = [bytes_to_str(m) for m in moved]
        outcome["removed"].update(zip(moved[::2], moved[1::2], strict=True))
        outcome["inflight"] += [bytes_to_str(i) for i in inflight]
        outcome["queued"] += [bytes_to_str(q) for q in queued]
    if terminate:
        outcome["stop_requested"] = [i for i in ids if request_stop(client, settings, i)]
    return outcome


def copy_revokes(client: Any, keys: Keys, targets: Sequence[Keys]) -> int:
    """Cluster: write the home copy's revokes into the copies ``targets`` of job queues a
    pool joins now, before its first fetch there. A revoke is written to the copies of the
    job queues known at the time; a queue first seen later (a job enqueued with a revoked
    id, then a pool for its queue) would otherwise have none. Called after the queues
    are in the home registry (see :func:`revoke`). Costs one read of the home's revokes
    and, when there are any, one pipeline writing up to ``revoked_max`` ids per copy.
    Returns how many ids were copied to each."""
    home = keys.home
    with client.pipeline(transaction=False) as pipe:
        pipe.zrange(home.revoked, 0, -1, withscores=True)
        pipe.hgetall(home.revoked_by)
        pairs, metas = pipe.execute()
    if not pairs:
        return 0
    lapses = {i: int(score) for i, score in pairs}
    last = max(lapses.values())
    targets = [t for t in targets if t != home]
    per_copy(client, targets, lambda pipe, copy: (
        pipe.zadd(copy.revoked, lapses, gt=True),
        pipe.hset(copy.revoked_by, mapping=metas) if metas else None,
        # (the keys go when their last revoke lapses, as revoke.lua's PEXPIRE)
        pipe.pexpireat(copy.revoked, last), pipe.pexpireat(copy.revoked_by, last)))
    return len(lapses)


def revoked(client: Any, keys: Keys) -> list[RevokedId]:
    """The revokes that hold now, oldest first, read from the home copy (every revoke
    is written there too)."""
    home = keys.home
    now = now_ms(client)
    pairs = client.zrange(home.revoked, f"({now}", "+inf", byscore=True, withscores=True)
    ids = [bytes_to_str(i) for i, _ in pairs]
    metas = client.hmget(home.revoked_by, ids) if ids else []
    out = []
    for (_, lapses), task_id, raw in zip(pairs, ids, metas, strict=True):
        try:
            meta = json.loads(raw) if raw else {}
        except ValueError:
            meta = {}
        out.append(RevokedId(task_id=task_id, lapses_at=float(lapses) / 1000,
                             meta=meta if isinstance(meta, dict) else {}))
    return out


def revoked_ids(client: Any, keys: Keys) -> list[str]:
    """The task ids whose revoke holds now (what ``celery inspect revoked`` lists)."""
    return [r["task_id"] for r in revoked(client, keys)]


def lift(client: Any, keys: Keys, task_ids: Iterable[str]) -> None:
    """End the revokes of ``task_ids`` in every copy: a person retries a revoked job from
    the dead set (``JobSets``), and its fetch must not drop it again."""
    ids = [i for i in task_ids if i]
    if ids:
        per_copy(client, copies(client, keys), lambda pipe, copy: (
            pipe.zrem(copy.revoked, *ids), pipe.hdel(copy.revoked_by, *ids)))


def revoked_task_id(meta: dict[str, Any], payload: str) -> str | None:
    """The task id of a dead job whose record says it was revoked, else None."""
    if meta.get("reason") != "revoked":
        return None
    task_id = headers_of(payload).get("id")
    return task_id if isinstance(task_id, str) else None
