"""Periodic job entries for people: the state the leader records, pause and resume, and
one run now (``Client.periodic``, ``celery ext periodic``, the dashboard's page).

Readers fall back to the result backend for a run with no recorded outcome
(:func:`entry_rows`).
"""

from __future__ import annotations

import uuid
from typing import Any, TypedDict

from celery.beat import Scheduler
from kombu.utils.encoding import bytes_to_str

from celery_ext.options.periodic_schedule import load_entries
from celery_ext.producer.periodic_run import OUTCOMES, PeriodicRun, publish_run
from celery_ext.store.keys import Keys


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
    error: str | None  # why the last due time could not be enqueued




def _seconds(value: str | None) -> float | None:
    return int(value) / 1000 if value not in (None, "") else None


def entry_rows(client: Any, keys: Keys, app: Any = None) -> list[PeriodicEntry]:
    """Every entry the leader recorded, by name, with its last run's outcome (from the
    worker, else from ``app``'s result backend when there is one)."""
    names = sorted(bytes_to_str(n) for n in client.smembers(keys.periodic))
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.periodic_entry(name))
        hashes = pipe.execute()
    rows: list[PeriodicEntry] = []
    for name, raw in zip(names, hashes, strict=True):
        h = {bytes_to_str(a): bytes_to_str(b) for a, b in raw.items()}
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
            error=h.get("error") or None))
    return rows


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
    """Enqueue one run of entry ``name`` now, outside its schedule (also when paused).
    Returns its job id, or None when ``app``'s ``beat_schedule`` has no such entry."""
    entry = load_entries(app).get(name)
    if entry is None:
        return None
    if not client.sismember(keys.periodic, name):
        client.sadd(keys.periodic, name)  # shown before any leader recorded it
    run = PeriodicRun(name, str(uuid.uuid4()), None, 0, None)
    publish_run(Scheduler(app, lazy=True), entry, run)
    return run.job_id
