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
* a job the job index finds in the scheduled or retry set moves to the dead set at once;
* a job in flight is reported: with ``terminate``, it gets a stop request (its next
  checkin answers "stop"; Celery's own terminate reaches its worker through the
  broadcast).

On a cluster a fetch touches its job queue's copy only, so the id is written to every
copy (``copies``: the home copy and every known job queue's), one script per copy, in
one pipeline per master. A job queue first seen after the revoke has no copy of it.

A person who retries a revoked job from the dead set lifts its revoke first (:func:`lift`),
so the retried job runs.

Bounded: a revoke lapses ``revoked_ttl`` seconds after it was made, and a copy keeps at
most ``revoked_max`` ids (Celery's ``REVOKE_EXPIRES`` and ``REVOKES_MAX``); each revoke
drops up to 100 lapsed ids and 100 over the cap, and both keys of a copy expire when its
last revoke lapses (a copy no later revoke visits goes whole).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterable
from typing import Any, TypedDict

from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings
from celery_ext.store.clock import now_ms
from celery_ext.store.copies import copies, per_copy, run_scripts
from celery_ext.store.job_index import index_ttl_ms
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.store.stop_requests import request_stop


class RevokeOutcome(TypedDict):
    """What one revoke did, by task id."""

    #: Moved from the scheduled or retry set to the dead set: id -> "scheduled" / "retry".
    removed: dict[str, str]
    #: Queued now: dropped, to the dead set, by the fetch that pops it.
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
            settings.dead_max_size, int(settings.dead_max_age * 1000), index_ttl_ms(settings),
            *ids]
    calls = [("revoke", [copy.revoked, copy.revoked_by, copy.job_index, copy.job_index_done,
                         copy.dead, copy.dead_jobs, copy.scheduled, copy.retry,
                         copy.scheduled_jobs], args)
             for copy in copies(client, keys)]
    for moved, inflight, queued in run_scripts(client, scripts, calls):
        moved = [bytes_to_str(m) for m in moved]
        outcome["removed"].update(zip(moved[::2], moved[1::2], strict=True))
        outcome["inflight"] += [bytes_to_str(i) for i in inflight]
        outcome["queued"] += [bytes_to_str(q) for q in queued]
    if terminate:
        outcome["stop_requested"] = [i for i in ids if request_stop(client, settings, i)]
    return outcome


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
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        task_id = json.loads(payload)["headers"]["id"]
        return task_id if isinstance(task_id, str) else None
    return None
