"""One job's status by its id, for the job observer widget and ``celery ext job``.

Where a job is comes from the job index (:mod:`celery_ext.store.job_index`): one read, kept by
the same scripts that move the job, so it says queued (which queue, which priority
level), in flight (which pool, found by the job's delivery tag in the pools' in-flight
records in the same read, :func:`~celery_ext.store.job_index.lookup`; ``running`` when
that pool's busy records show it, else ``reserved``), scheduled, retrying, dead, or done
(when, which pool); the result backend adds the outcome of a done job (``finished``
without a backend), the checkin record the progress, the cursor record
(:mod:`celery_ext.worker.cursor`, in the job queue's copy) a resumable job's position.
A job is ``queued`` only when its entry says so and no pool holds it in flight.

A job without an entry (enqueued before the index existed, or ``job_index=False``) is
searched for as follows. Its state is spread over several records: the result backend knows finished
jobs (and started ones with ``task_track_started``), the busy-worker records and
checkins know running jobs, the dead, scheduled and retry sets know jobs parked
there. :func:`job_status` reads them in the order that answers cheapest:

1. the checkin record and the result backend (one read each);
2. for running jobs, the busy-worker records of every live pool (one pipeline);
3. the most recent entries of the dead set (failures land there seconds ago);
4. when still unknown, the scheduled and retry sets, only while they are small
   (``deep=True``): they are keyed by delivery tag, not job id.

Such a job found nowhere is reported ``queued``: a job id nobody enqueued looks the
same (as Celery's ``PENDING``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from celery_ext.admin.api_types import JobStatus, UniqueLock
from celery_ext.config import Settings
from celery_ext.options.unique import UNTIL_FINISHED, UNTIL_STARTED, finished_lock, lock_of
from celery_ext.store.clock import now_ms
from celery_ext.store.compact import headers_of
from celery_ext.store.copies import copies
from celery_ext.store.dead_set import split_record
from celery_ext.store.job_index import IndexEntry, lookup
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.store.stop_requests import requested

#: States after which nothing changes any more (the widget stops watching); "finished":
#: done, with no result backend to say how.
FINAL_STATES = frozenset({"succeeded", "failed", "dead", "revoked", "finished"})
#: How many of the newest dead jobs are searched for a job id.
DEAD_SCAN = 50
#: The scheduled and retry sets are searched only while they hold at most this many jobs.
SCHEDULED_SCAN_MAX = 500
#: Characters of repr(result) or of an error message kept in a status.
TEXT_MAX = 1000


def _cut(text: str, limit: int = TEXT_MAX) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _timestamp(value: Any) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    if isinstance(value, int | float):
        return float(value)
    return None


def _error_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, BaseException):
        return _cut(f"{type(value).__name__}: {value}")
    if isinstance(value, dict) and "exc_type" in value:
        message = value.get("exc_message")
        if isinstance(message, list | tuple):
            message = ", ".join(str(m) for m in message)
        return _cut(f"{value['exc_type']}: {message}")
    return _cut(str(value))


def _payload_task_id(payload: str) -> str | None:
    value = headers_of(payload).get("id")
    return str(value) if value is not None else None


def _payload_task_name(payload: str) -> str | None:
    """The task name of a Kombu payload (``headers.task``), or None."""
    value = headers_of(payload.partition("\n")[2] if payload[:1] != "{" else payload
                       ).get("task")
    return str(value) if value is not None else None


def _cursor_value(raw: bytes | str | None) -> Any:
    """The JSON value of a ``"<owner tag>\n<cursor json>"`` cursor record; None when the
    job keeps none (or the record is unreadable: a status never fails on it)."""
    if not raw:
        return None
    _owner, _, body = bytes_to_str(raw).partition("\n")
    try:
        return json.loads(body)
    except ValueError:
        return None


def new_status(job_id: str, state: str = "queued", **fields: Any) -> JobStatus:
    status = JobStatus(
        job_id=job_id, state=state, done=state in FINAL_STATES, job_name=None,
        progress=None, message=None, checkin_at=None, started_at=None, due_at=None,
        finished_at=None, result=None, error=None, dead_id=None, stop_requested=False,
        queue=None, level=None, pool=None, indexed=False, cursor=None,
        unique_lock=None)
    status.update(fields)  # type: ignore[typeddict-item]
    return status


def backend_meta(app: Any, job_id: str) -> dict[str, Any] | None:
    """The result backend's record of a job, or None without a usable backend."""
    if app is None:
        return None
    try:
        backend = app.backend
        # No cache: a dead job retried by hand fails or succeeds again under its id.
        meta = backend.get_task_meta(job_id, cache=False)
    except (NotImplementedError, AttributeError, TypeError):
        return None
    return meta if isinstance(meta, dict) else None


class JobLookup:
    """Finds one job's state in the plugin's records and the app's result backend."""

    def __init__(self, client: redis.Redis, settings: Settings, app: Any = None,
                 scripts: Scripts | None = None) -> None:
        self.client: Any = client  # sync client (redis-py types replies as unions)
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.app = app
        self.scripts = scripts or Scripts(client)

    def status(self, job_id: str, deep: bool = True) -> JobStatus:
        """The job's state now. ``deep`` also searches small scheduled/retry sets."""
        k = self.keys
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hget(k.checkins, job_id)
            pipe.zscore(k.stop_requests, job_id)
            if not k.cluster:
                pipe.get(k.cursor(job_id))
            checkin, stop, *cursor = pipe.execute()
        status = new_status(job_id, stop_requested=stop is not None and requested(
            stop, now_ms(self.client)))
        if checkin:
            at, _, body = bytes_to_str(checkin).partition("\n")
            try:
                data = json.loads(body)
            except ValueError:
                data = {}
            status["checkin_at"] = int(at) / 1000 if at.isdigit() else None
            status["progress"] = data.get("progress")
            status["message"] = data.get("message")

        meta = backend_meta(self.app, job_id) or {}
        state = str(meta.get("status") or "PENDING")
        status["job_name"] = meta.get("name")
        status["finished_at"] = _timestamp(meta.get("date_done"))
        entry = lookup(self.client, k, job_id, self.scripts)
        if k.cluster and entry is not None:
            # On a cluster the cursor lives in the job queue's copy, which the entry names.
            cursor = [self.client.get(k.of(entry["queue"]).cursor(job_id))]
        status["cursor"] = _cursor_value(cursor[0] if cursor else None)
        if entry is not None and entry["state"] == "queued" and entry["ref"].isdigit() \
                and not self.client.llen(k.of(entry["queue"]).queue_level(entry["queue"],
                                                                          int(entry["ref"]))):
            entry = None  # its queue was purged or deleted (no script moved the job)
        if entry is not None:
            return self._from_index(status, entry, meta, state)
        if state == "SUCCESS":
            status.update({"state": "succeeded", "done": True,
                           "result": _cut(repr(meta.get("result")))})
            return status
        if state == "REVOKED":
            status.update({"state": "revoked", "done": True})
            return status
        if state == "FAILURE":
            status.update({"state": "failed", "done": True,
                           "error": _error_text(meta.get("result"))})
            since = status["finished_at"]
            self._find_dead(status, since_ms=int((since - 30) * 1000) if since else None)
            return status
        if state == "RETRY":
            status.update({"state": "retrying", "error": _error_text(meta.get("result"))})
            if self._find_busy(status):
                return status  # already running again
            if deep:
                self._find_scheduled(status)
            return status
        if checkin or state == "STARTED" or state not in ("PENDING", "RECEIVED"):
            status["state"] = "running"
            self._find_busy(status)
            return status
        if self._find_busy(status):
            return status
        if self._find_dead(status):
            return status
        if deep:
            self._find_scheduled(status)
        return status

    def _from_index(self, status: JobStatus, entry: IndexEntry, meta: dict[str, Any],
                    state: str) -> JobStatus:
        """The status from the job's index entry, with the backend's outcome and error."""
        where, at = entry["state"], entry["at"]
        status.update({"indexed": True, "queue": entry["queue"]})
        finished = status["finished_at"]
        # The backend's outcome belongs to this run only if written after the move that
        # queued the run (a dead job retried by hand keeps its old FAILURE until it runs
        # again): for a done entry that is the move before the ack, which it keeps, since
        # the ack may land seconds after the outcome was stored (acks batched, a warm
        # stop, an outage); for a live entry, or a done one an earlier version wrote,
        # the entry's own move. The second of slack is for the worker's clock, which
        # dates the outcome, against Redis's.
        since = entry["queued_at"] if entry["queued_at"] is not None else at
        final = state in ("SUCCESS", "FAILURE", "REVOKED") and finished is not None \
            and finished >= since - 1
        if where == "queued":
            status.update({"state": "queued", "level": int(entry["ref"] or 0),
                           "finished_at": None})
        elif where in ("scheduled", "retry"):
            # The set's score: "run now" (client) moves it without a script.
            due = self.client.zscore(self.keys.of(entry["queue"]).retry if where == "retry"
                                     else self.keys.of(entry["queue"]).scheduled, entry["ref"])
            status.update({"state": "retrying" if where == "retry" else "scheduled",
                           "finished_at": None, "due_at": due / 1000 if due is not None
                           else None})
            record, payload = self._record(self.keys.of(entry["queue"]).scheduled_jobs,
                                           entry["ref"])
            status["job_name"] = status["job_name"] or record.get("name")
            status["unique_lock"] = self._unique_lock(entry["queue"], payload)
            error = _error_text(meta.get("result")) if state == "RETRY" else record.get("error")
            status["error"] = _cut(str(error)) if error else None
        elif where == "dead":
            status.update({"state": "dead", "done": True, "dead_id": entry["ref"],
                           "finished_at": at})
            record, payload = self._record(self.keys.of(entry["queue"]).dead_jobs, entry["ref"])
            status["job_name"] = status["job_name"] or record.get("name")
            status["unique_lock"] = self._unique_lock(entry["queue"], payload)
            status["error"] = _cut(str(record.get("error") or record.get("reason")
                                       or "")) or None
        elif where == "inflight" or not final:
            # Done while no outcome is known: acked when it started (acks_late off).
            status.update({"pool": entry["detail"] or None, "finished_at": None})
            if where == "inflight":
                raw = self.client.hget(self.keys.of(entry["queue"]).inflight(entry["detail"]),
                                       entry["ref"])
                # ("<queue>\n<payload>")
                payload = bytes_to_str(raw).partition("\n")[2] if raw else ""
                status["job_name"] = status["job_name"] or _payload_task_name(payload)
                status["unique_lock"] = self._unique_lock(entry["queue"], payload)
            if not final and self._find_busy(status, [entry["detail"]]):
                return status
            if where == "inflight" and not final:
                status["state"] = "running" if status["checkin_at"] or state == "STARTED" \
                    else "reserved"
                return status
            if not final:
                status.update({"state": "finished", "done": True, "finished_at": at})
                return status
        if final and where in ("inflight", "done"):
            status["pool"] = entry["detail"] or None
            if state == "SUCCESS":
                status.update({"state": "succeeded", "done": True,
                               "result": _cut(repr(meta.get("result")))})
            elif state == "REVOKED":
                status.update({"state": "revoked", "done": True})
            else:
                status.update({"state": "failed", "done": True,
                               "error": _error_text(meta.get("result"))})
        return status

    def _record(self, records: str, record_id: str) -> tuple[dict[str, Any], str]:
        """The meta of a ``"<meta json>\n<queue>\n<payload>"`` record, with its job
        name (the meta's, else the payload's), and its payload; ({}, "") when gone or
        unreadable."""
        raw = self.client.hget(records, record_id)
        try:
            meta, _queue, payload = split_record(raw) if raw else ({}, "", "")
        except ValueError:
            return {}, ""
        if not meta.get("name"):
            meta["name"] = _payload_task_name(payload)
        return meta, payload

    def _unique_lock(self, queue: str, payload: str) -> UniqueLock | None:
        """The lock of a unique job whose message is ``payload`` (its key travels in
        the message's headers), in its job queue's copy: who holds it now and for how
        much longer. None when the message is not a unique job's."""
        found = lock_of(payload) if payload else None
        if found is None:
            return None
        digest, task_id = found
        mode = UNTIL_FINISHED if finished_lock(headers_of(payload)) \
            else UNTIL_STARTED
        with self.client.pipeline(transaction=False) as pipe:
            key = self.keys.of(queue).unique(digest)
            pipe.get(key)
            pipe.pttl(key)
            value, ttl_ms = pipe.execute()
        holder = bytes_to_str(value).partition("\n")[0] if value else None
        return UniqueLock(key=digest, mode=mode, held=holder == task_id, holder=holder,
                          ttl=ttl_ms / 1000 if value and ttl_ms > 0 else None)

    # -- the places a job can be -------------------------------------------------------------
    def _find_busy(self, status: JobStatus, pools: list[str] | None = None) -> bool:
        k = self.keys
        ids = pools if pools is not None else [
            bytes_to_str(p) for p in self.client.zrange(k.pools, 0, -1)]
        if not ids:
            return False
        with self.client.pipeline(transaction=False) as pipe:
            for pool_id in ids:
                pipe.hvals(k.busy(pool_id))
            replies = pipe.execute()
        needle = json.dumps(status["job_id"])
        for values in replies:
            for raw in values:
                text = bytes_to_str(raw)
                if needle not in text:
                    continue
                started, _, body = text.partition("\n")
                try:
                    record = json.loads(body)
                except ValueError:
                    continue
                if record.get("job_id") != status["job_id"]:
                    continue
                status["state"] = "running"
                status["done"] = False
                status["job_name"] = record.get("job_name") or status["job_name"]
                status["started_at"] = int(started) / 1000 if started.isdigit() else None
                return True
        return False

    def _find_dead(self, status: JobStatus, since_ms: int | None = None) -> bool:
        """The job in the newest part of the dead set (of each copy, on a cluster)."""
        return any(self._find_dead_in(k, status, since_ms)
                   for k in copies(self.client, self.keys))

    def _find_dead_in(self, k: Keys, status: JobStatus, since_ms: int | None) -> bool:
        if since_ms is None:
            ids = self.client.zrevrange(k.dead, 0, DEAD_SCAN - 1)
        else:
            ids = self.client.zrevrangebyscore(k.dead, "+inf", since_ms, start=0, num=DEAD_SCAN)
        if not ids:
            return False
        job_id = status["job_id"]
        for dead_id, raw in zip(ids, self.client.hmget(k.dead_jobs, ids), strict=True):
            if not raw:
                continue
            try:
                meta, queue, payload = split_record(raw)
            except ValueError:
                continue
            if meta.get("task_id") != job_id and (
                    job_id not in payload or _payload_task_id(payload) != job_id):
                continue
            status.update({"state": "dead", "done": True, "dead_id": bytes_to_str(dead_id),
                           "job_name": meta.get("name") or status["job_name"] or queue,
                           "error": _cut(str(meta.get("error") or meta.get("reason") or ""))})
            failed_at = self.client.zscore(k.dead, dead_id)
            if failed_at is not None:
                status["finished_at"] = failed_at / 1000
            return True
        return False

    def _find_scheduled(self, status: JobStatus) -> bool:
        """The job in small scheduled and retry sets (of each copy, on a cluster)."""
        return any(self._find_scheduled_in(k, status) for k in copies(self.client, self.keys))

    def _find_scheduled_in(self, k: Keys, status: JobStatus) -> bool:
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zcard(k.scheduled)
            pipe.zcard(k.retry)
            sizes = pipe.execute()
        if not any(sizes) or sum(sizes) > SCHEDULED_SCAN_MAX:
            return False
        job_id = status["job_id"]
        for zset, state in ((k.retry, "retrying"), (k.scheduled, "scheduled")):
            members = self.client.zrange(zset, 0, -1, withscores=True)
            if not members:
                continue
            tags = [m for m, _ in members]
            for (_tag, due), raw in zip(members, self.client.hmget(k.scheduled_jobs, tags),
                                       strict=True):
                if not raw or job_id.encode() not in raw:
                    continue
                try:
                    meta, _queue, payload = split_record(raw)
                except ValueError:
                    continue
                if meta.get("task_id") != job_id and _payload_task_id(payload) != job_id:
                    continue
                status.update({"state": state, "done": False, "due_at": due / 1000,
                               "job_name": meta.get("name") or status["job_name"]})
                if meta.get("error"):
                    status["error"] = _cut(str(meta["error"]))
                return True
        return False

    def server_time(self) -> float:
        return now_ms(self.client) / 1000
