"""Periodic job entries for people: the state the leader records, entries set and removed
at runtime, pause and resume, and one run now (``Client.periodic``, ``celery ext
periodic``, the dashboard's page).

An entry set at runtime (:func:`set_entry`) is a record in ``{ns}:periodic_runtime``
(``store/runtime_schedules.py``), checked there by the one function the client, the CLI
and the JSON API share; it wins over the app's ``beat_schedule`` entry of the same name,
which comes back when the runtime entry is removed. Each row says which it is
(``source``: "config" or "runtime").

Readers fall back to the result backend for a run with no recorded outcome
(:func:`entry_rows`).
"""

from __future__ import annotations

import uuid
from typing import Any, TypedDict

from celery.beat import Scheduler
from kombu.utils.encoding import bytes_to_str

from celery_ext.options.periodic_schedule import describe, load_entries
from celery_ext.producer.periodic_run import OUTCOMES, PeriodicRun, publish_run
from celery_ext.store.keys import Keys
from celery_ext.store.runtime_schedules import (
    InvalidPeriodicEntry,
    check_entry,
    encode,
    entry_from_record,
)
from celery_ext.worker.periodic_leader import STALE_STATE_TTL_MS


class PeriodicEntry(TypedDict):
    name: str
    task: str | None
    schedule: str | None
    next_due: float | None  # seconds, Redis clock
    last_due: float | None  # the due time of the last run (None for a run-now)
    last_run_at: float | None  # when the last run was enqueued
    last_job_id: str | None
    last_outcome: str | None  # success, failure, retry, pending (not finished), or None
    runs: int
    missed: int  # due times passed over without their own run (missed, skipped, paused)
    paused: bool
    error: str | None  # why the last due time could not be enqueued (or the record is broken)
    source: str  # "runtime" (set at runtime, wins) or "config" (the app's beat_schedule)


def _seconds(value: str | None) -> float | None:
    return int(value) / 1000 if value not in (None, "") else None


def entry_rows(client: Any, keys: Keys, app: Any = None) -> list[PeriodicEntry]:
    """Every entry the leader recorded, by name, with its last run's outcome (from the
    worker, else from ``app``'s result backend when there is one)."""
    names = sorted(bytes_to_str(n) for n in client.smembers(keys.periodic))
    with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.periodic_runtime)
        for name in names:
            pipe.hgetall(keys.periodic_entry(name))
        runtime, *hashes = pipe.execute()
    records = {bytes_to_str(k): bytes_to_str(v) for k, v in runtime.items()}
    rows: list[PeriodicEntry] = []
    for name, raw in zip(names, hashes, strict=True):
        h = {bytes_to_str(a): bytes_to_str(b) for a, b in raw.items()}
        if name in records:
            try:
                entry_from_record(name, records[name], app)
            except InvalidPeriodicEntry as exc:
                h["error"] = f"the stored record is broken (skipped): {exc.why}"
        job_id = h.get("last_job_id") or None
        outcome = h.get("outcome") if job_id and h.get("outcome_job_id") == job_id else None
        if job_id and outcome is None:
            outcome = _backend_outcome(app, job_id)
        rows.append(PeriodicEntry(
            name=name, task=h.get("task"), schedule=h.get("schedule"),
            next_due=_seconds(h.get("next_due")), last_due=_seconds(h.get("last_due")),
            last_run_at=_seconds(h.get("last_run_at")), last_job_id=job_id,
            last_outcome=outcome, runs=int(h.get("runs") or 0),
            missed=int(h.get("missed") or 0), paused=h.get("paused") == "1",
            error=h.get("error") or None,
            source="runtime" if name in records else "config"))
    return rows


def set_entry(client: Any, keys: Keys, name: str, task: str, every: float | None = None,
              crontab: str | None = None, args: Any = (), kwargs: Any = None,
              options: Any = None, app: Any = None) -> bool:
    """Create or replace the runtime entry ``name`` after :func:`check_entry` (raises
    :class:`InvalidPeriodicEntry`, a ValueError, and stores nothing); True when it was
    new. The leader runs it from its next pass; a changed schedule counts from then."""
    record = check_entry(name, task, every, crontab, args, kwargs, options, app)
    text = encode(record)
    shown = describe(entry_from_record(name, text, app).schedule)
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(keys.periodic_runtime, name, text)
        pipe.sadd(keys.periodic, name)
        pipe.persist(keys.periodic_entry(name))
        pipe.hset(keys.periodic_entry(name),
                  mapping={"task": task, "schedule": shown, "source": "runtime"})
        created = pipe.execute()[0]
    return bool(created)


def remove_entry(client: Any, keys: Keys, name: str) -> bool:
    """Remove the runtime entry ``name``; False when there is none (an entry of the app's
    ``beat_schedule`` is changed in the app). Its state's spec is cleared in the same
    step, so no run planned before is written after; the app's entry of that name, if
    any, is back (with its own schedule's due times) at the leader's next pass."""
    if not client.hexists(keys.periodic_runtime, name):
        return False
    state = keys.periodic_entry(name)
    with client.pipeline(transaction=True) as pipe:
        pipe.hdel(keys.periodic_runtime, name)
        pipe.hset(state, "spec", "")
        pipe.srem(keys.periodic, name)
        pipe.pexpire(state, STALE_STATE_TTL_MS)
        removed = pipe.execute()[0]
    return bool(removed)


def _backend_outcome(app: Any, job_id: str) -> str:
    """The result backend's word on a run, "pending" when it has none (or no backend)."""
    backend = getattr(app, "backend", None) if app is not None else None
    if backend is None or type(backend).__name__ == "DisabledBackend":
        return "pending"
    try:
        state = app.AsyncResult(job_id).state
    except Exception:
        return "pending"
    return OUTCOMES.get(state, "pending")


def set_paused(client: Any, keys: Keys, name: str, paused: bool) -> bool | None:
    """Pause or resume an entry; None when no entry has that name, else whether it
    changed. A paused entry's due times pass without runs (``missed`` counts them)."""
    if not client.sismember(keys.periodic, name):
        return None
    key = keys.periodic_entry(name)
    if paused:
        return bool(client.hset(key, "paused", "1"))
    return bool(client.hdel(key, "paused"))


def run_now(app: Any, client: Any, keys: Keys, name: str) -> str | None:
    """Enqueue one run of entry ``name`` now, outside its schedule (also when paused):
    the runtime entry of that name, else ``app``'s ``beat_schedule`` entry. Returns its
    job id, or None when neither has it."""
    raw = client.hget(keys.periodic_runtime, name)
    entry = entry_from_record(name, raw, app) if raw is not None else load_entries(app).get(name)
    if entry is None:
        return None
    if not client.sismember(keys.periodic, name):
        client.sadd(keys.periodic, name)  # shown before any leader recorded it
    run = PeriodicRun(name, str(uuid.uuid4()), None, 0, None)
    publish_run(Scheduler(app, lazy=True), entry, run)
    return run.job_id
