"""The read/admin API of celery_ext: the one module the dashboard and the CLI use.

    from celery_ext.client import Client
    client = Client.from_app(app)              # or Client.from_url("celery-ext://...")
    client.dead(limit=20, name="tasks.flaky")  # newest first
    client.retry_dead(job_id)                  # back to the front of its job queue
    client.pause("tasks.report")

Job queues, worker pools and busy workers come from :class:`celery_ext.state.State`;
this module adds the scheduled, retry and dead sets, pause/resume, concurrency
and rate limits. Every write is one script or one MULTI, and idempotent: two people pressing
"retry" on the same dead job requeue it once. Times are seconds on the Redis clock.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypedDict, TypeVar

import redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps

from celery_ext.admin.overview import BusyWorker, PoolInfo, QueueInfo, State
from celery_ext.config import Settings
from celery_ext.options.fair import message_fair_key
from celery_ext.options.priority import level, payload_priority
from celery_ext.options.rate_limits import format_rate, interval_us
from celery_ext.options.unique import lock_of
from celery_ext.store.connections import client_from_url, cluster_client, cluster_config
from celery_ext.store.copies import copies, per_copy, queue_of, set_counts
from celery_ext.store.dead_set import split_record
from celery_ext.store.job_index import index_keys, index_ttl_ms
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts

__all__ = ["Client", "DeadJob", "Page", "ScheduledJob", "SetCounts"]

T = TypeVar("T")

#: Jobs read (or moved) per round trip when listing with a filter or acting on all.
CHUNK = 200
#: Header counting how often a person retried a job from the dead set.
MANUAL_RETRIES_HEADER = "celery_ext_manual_retries"


class Page(TypedDict, Generic[T]):
    items: list[T]
    total: int  # matching jobs in the whole set
    offset: int
    limit: int


class ScheduledJob(TypedDict):
    id: str  # the job's id in the set (its delivery tag)
    name: str
    task_id: str | None
    queue: str
    args: Any
    kwargs: Any
    due_at: float  # when the requeuer moves it to its job queue
    scheduled_at: float | None
    retry: bool  # in the retry set (a retry of a failed attempt)
    attempt: int  # retries so far (0 for a plain countdown/eta job)
    error: str | None  # last error, for retries
    exc_type: str | None
    traceback: str | None
    eta: str | None
    expires: str | None


class DeadJob(TypedDict):
    id: str  # the job's id in the dead set (its delivery tag)
    name: str
    task_id: str | None
    queue: str
    reason: str  # see celery_ext.dead.REASONS
    error: str
    exc_type: str | None
    exc_message: str | None
    traceback: str | None
    args: Any
    kwargs: Any
    attempts: int | None
    pool: str | None
    hostname: str | None
    failed_at: float
    manual_retries: int
    payload: str | None  # the raw message (show one only)
    fair_key: str | None  # the job's fair key (fair.py), if it has one


class SetCounts(TypedDict):
    scheduled: int
    retry: int
    dead: int


def _decode_message(payload: str) -> dict[str, Any]:
    try:
        message = json.loads(payload)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


def _headers(message: dict[str, Any]) -> dict[str, Any]:
    headers = message.get("headers")
    return headers if isinstance(headers, dict) else {}


def _body_args(message: dict[str, Any]) -> tuple[Any, Any]:
    """(args, kwargs) of a JSON task message (protocol 2); (None, None) otherwise."""
    try:
        if message.get("content-type") != "application/json":
            return None, None
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, kwargs, *_ = json.loads(body)
        return args, kwargs
    except Exception:
        return None, None


def _int(value: Any) -> int:
    """A count from a header that anyone could have written: 0 unless a whole number."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value == value and abs(value) < 2**63 else 0  # not NaN/inf
    try:
        return int(value) if isinstance(value, str) else 0
    except ValueError:
        return 0


def _str_or_none(value: Any) -> str | None:
    """A header meant to be a string (task id, eta); anything else is shown as None."""
    return value if isinstance(value, str) else None


def _job_name(meta: dict[str, Any], queue: str, message: dict[str, Any]) -> str:
    return str(meta.get("name") or _headers(message).get("task") or queue)


def _manual_retry_payload(payload: str, now: float) -> str:
    """The message a manual retry enqueues: attempts reset, no eta or expiry left
    over from the failed run, one more manual retry counted, and enqueued ``now``
    (Redis seconds), so its queue's latency counts from the retry, not the first
    enqueue."""
    message = _decode_message(payload)
    headers = message.get("headers")
    if not isinstance(headers, dict):
        return payload  # undecodable: requeued as it is
    headers["retries"] = 0
    headers["eta"] = None
    headers["expires"] = None
    headers[MANUAL_RETRIES_HEADER] = _int(headers.get(MANUAL_RETRIES_HEADER)) + 1
    props = message.get("properties")
    if isinstance(props, dict):  # (kept in place: it stays after the delivery tag)
        props["enqueued_at"] = round(now, 3)
    return str(dumps(message))  # kombu's separators: fetch finds the delivery tag by them


class Client:
    """Reads and steers one namespace of a celery_ext Redis."""

    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        # redis-py types replies as sync/async unions; this is the sync client.
        self.client: Any = client
        self.settings = settings or Settings()
        self.keys = Keys.for_settings(self.settings)
        self.scripts = Scripts(client)
        self.state = State(client, self.settings)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Client:
        """Connect to a ``celery-ext://`` (or ``redis://``, or ``celery-ext+sentinel://``)
        URL; ``options`` are the transport options (``namespace=...``, ``master_name=...``),
        overridden by ``CELERY_EXT_*``."""
        return cls(client_from_url(url, options), Settings.load(options))

    @classmethod
    def from_app(cls, app: Any) -> Client:
        """Connect like ``app``'s broker does (URL, TLS, transport options)."""
        cluster = _cluster_client(app)
        if cluster is not None:
            return cls(cluster, Settings.load(app.conf.broker_transport_options))
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            if not hasattr(channel, "settings"):
                raise ValueError(f"celery_ext: {app.main!r} does not use the celery-ext:// "
                                 "broker transport")
            return cls(channel.new_client(), channel.settings)

    # -- queues, pools, busy workers (celery_ext.state) ----------------------------------
    def job_queues(self, offset: int = 0, limit: int | None = None,
                   prefix: str | None = None) -> list[QueueInfo]:
        return self.state.job_queues(offset, limit, prefix)

    def worker_pools(self) -> list[PoolInfo]:
        return self.state.worker_pools()

    def busy_workers(self) -> list[BusyWorker]:
        return self.state.busy_workers()

    def request_stop(self, job_id: str) -> bool:
        return self.state.request_stop(job_id)

    def counts(self) -> SetCounts:
        """Sizes of the scheduled, retry and dead sets (summed over the copies)."""
        scheduled, retry, dead = set_counts(self.client, self.keys)
        return SetCounts(scheduled=int(scheduled), retry=int(retry), dead=int(dead))

    # -- pause, resume, limits -----------------------------------------------------------
    def pause(self, queue: str) -> bool:
        """Stop fetching from a job queue; its jobs stay. False if already paused."""
        return bool(self.client.sadd(self.keys.of(queue).paused, queue))

    def resume(self, queue: str) -> bool:
        """Fetch from a paused job queue again (idle pools are woken). False if it
        was not paused."""
        removed, = self._steer(queue, lambda pipe, k: pipe.srem(k.paused, queue))
        return bool(removed)

    def paused(self) -> list[str]:
        return sorted({bytes_to_str(q) for (names,) in self._each(lambda p, k: p.smembers(k.paused))
                       for q in names})

    def _each(self, read: Callable[[Any, Keys], object]) -> list[list[Any]]:
        """``read(pipe, copy)`` for every copy of the namespace (one on one node), one
        pipeline: each copy's replies."""
        return per_copy(self.client, copies(self.client, self.keys), read)

    def _steer(self, queue: str, write: Callable[[Any, Keys], object]) -> list[Any]:
        """``write(pipe, copy)`` in the copy holding ``queue``, as one MULTI, then wake
        idle pools for it: the PUBLISH is part of the MULTI on one node; a cluster's
        pipeline cannot carry one, so it follows the MULTI there. The write's replies."""
        cluster = self.keys.cluster
        with self.client.pipeline(transaction=True) as pipe:
            write(pipe, self.keys.of(queue))
            if not cluster:
                pipe.publish(self.keys.wake_channel, queue)
            replies = pipe.execute()
        if cluster:
            self.client.publish(self.keys.wake_channel, queue)
            return list(replies)
        return list(replies[:-1])

    def set_max_concurrency(self, queue: str, limit: int | None) -> None:
        """Cap (or, with None, uncap) how many jobs of a queue run at once in all
        pools. Worker pools rewrite the limits of their queues from task options when
        they start, so this lasts until the next pool starts."""
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_concurrency must be a whole number >= 1, got {limit!r}")
        self._steer(queue, lambda pipe, k: pipe.hdel(k.limits, queue) if limit is None
                    else pipe.hset(k.limits, queue, limit))

    def limits(self) -> dict[str, int]:
        # (Fields "<queue>\n" are per-fair-key limits, fair.py: not a queue's.)
        return {bytes_to_str(q): int(n) for (found,) in self._each(lambda p, k: p.hgetall(k.limits))
                for q, n in found.items() if not q.endswith(b"\n")}

    def set_rate_limit(self, queue: str, limit: str | None) -> str | None:
        """Limit (or, with None, unlimit) how often jobs of a queue start, in all pools:
        a Celery rate like ``"20/s"``, ``"10/m"``, ``"5/h"``. The queue's next job is
        due at once. Worker pools rewrite the limits of their queues from task options
        when they start, so this lasts until the next pool starts. Returns the limit
        as stored (``"20/s"``), or None. Raises ValueError for anything not a rate."""
        interval = interval_us(limit) if limit is not None else None
        self._steer(queue, lambda pipe, k: (
            pipe.hdel(k.rate_limits, queue) if interval is None
            else pipe.hset(k.rate_limits, queue, interval), pipe.hdel(k.rate_tat, queue)))
        return format_rate(interval) if interval is not None else None

    def rate_limits(self) -> dict[str, str]:
        """Job queue -> its cluster-wide rate limit (``"20/s"``)."""
        return {bytes_to_str(q): format_rate(int(n))
                for (found,) in self._each(lambda p, k: p.hgetall(k.rate_limits))
                for q, n in found.items()}

    # -- scheduled and retry sets ---------------------------------------------------------
    def scheduled(self, offset: int = 0, limit: int = 50,
                  name: str | None = None) -> Page[ScheduledJob]:
        """Jobs waiting for their countdown/eta, soonest first."""
        return self._page("scheduled", "scheduled_jobs", offset, limit, name,
                          newest_first=False, build=self._scheduled_job)

    def retries(self, offset: int = 0, limit: int = 50,
                name: str | None = None) -> Page[ScheduledJob]:
        """The retry set: failed jobs waiting for their next attempt, soonest first,
        with attempt number, last error and next run time (``due_at``)."""
        return self._page("retry", "scheduled_jobs", offset, limit, name,
                          newest_first=False, build=self._scheduled_job)

    def run_scheduled_now(self, job_id: str) -> bool:
        """Make a scheduled job or retry due now (promoted within moments)."""
        return job_id in self._run_now([job_id])

    def delete_scheduled(self, job_id: str) -> bool:
        """Drop a job from the scheduled or retry set (it will not run); a unique job's
        lock is released with it, so an identical job can be enqueued at once."""
        return job_id in self._forget("scheduled_jobs", "scheduled", "retry", [job_id])

    # -- dead set ------------------------------------------------------------------------
    def dead(self, offset: int = 0, limit: int = 50, name: str | None = None) -> Page[DeadJob]:
        """Dead jobs, newest first, optionally only those of one job name."""
        return self._page("dead", "dead_jobs", offset, limit, name,
                          newest_first=True, build=self._dead_job)

    def dead_job(self, job_id: str) -> DeadJob | None:
        """One dead job with its raw message, or None if it is not (or no longer) dead."""
        for score, raw in self._each(lambda p, k: (p.zscore(k.dead, job_id),
                                                   p.hget(k.dead_jobs, job_id))):
            if score is not None and raw is not None:
                return self._dead_job(job_id, float(score), raw, with_payload=True)
        return None

    def retry_dead(self, job_id: str) -> bool:
        """Move one dead job to the front of its job queue, attempts reset and marked
        as a manual retry. False if it was not dead (e.g. already retried)."""
        return job_id in self._retry_dead_ids([job_id])

    def retry_all_dead(self, name: str | None = None) -> int:
        """Retry every dead job (of one job name); returns how many were requeued."""
        done = 0
        for chunk in self._dead_ids(name):
            done += len(self._retry_dead_ids(chunk))
        return done

    def delete_dead(self, job_id: str) -> bool:
        """Forget one dead job (releasing its unique lock, if it still holds one).
        False if it was not dead."""
        return job_id in self._forget("dead_jobs", "dead", "dead", [job_id])

    def delete_all_dead(self, name: str | None = None) -> int:
        """Forget every dead job (of one job name), releasing the unique locks they
        still hold; returns how many."""
        return sum(len(self._forget("dead_jobs", "dead", "dead", chunk))
                   for chunk in self._dead_ids(name))

    # -- internals -----------------------------------------------------------------------
    def _located(self, records: str, ids: list[str]) -> dict[Keys, list[str]]:
        """``ids`` by the copy whose ``records`` hash (a Keys attribute) holds them: on
        one node all in the one copy, without a round trip; on a cluster one HMGET per
        copy, in one pipeline (ids found nowhere are left out)."""
        parts = copies(self.client, self.keys)
        if len(parts) == 1:
            return {parts[0]: ids}
        found = per_copy(self.client, parts, lambda p, k: p.hmget(getattr(k, records), ids))
        out: dict[Keys, list[str]] = {}
        for k, (raws,) in zip(parts, found, strict=True):
            held = [i for i, raw in zip(ids, raws, strict=True) if raw is not None]
            if held:
                out[k] = held
        return out

    def _forget(self, records: str, first: str, second: str, ids: list[str]) -> set[str]:
        """Delete jobs from a set pair and its records hash (Keys attributes) with the
        ``forget`` script, in the copy holding each, releasing each unique job's lock;
        returns the ids deleted."""
        done: set[str] = set()
        for k, held in self._located(records, ids).items():
            done |= self._forget_in(k, getattr(k, records), getattr(k, first),
                                    getattr(k, second), held)
        return done

    def _forget_in(self, k: Keys, records: str, first: str, second: str,
                   ids: list[str]) -> set[str]:
        done: set[str] = set()
        for _ in range(3):  # a record that changed after it was read is read again
            keys = [records, first, second, *index_keys(k)]
            args: list[Any] = [index_ttl_ms(self.settings)]
            for job_id, raw in zip(ids, self.client.hmget(records, ids), strict=True):
                if raw is None:
                    continue
                try:
                    lock = lock_of(split_record(raw)[2])
                except ValueError:  # not "<meta>\n<queue>\n<payload>": no lock to find
                    lock = None
                if lock is not None:
                    keys.append(k.unique(lock[0]))
                args += [job_id, hashlib.sha1(raw).hexdigest(),
                         len(keys) if lock is not None else 0, lock[1] if lock else ""]
            if len(args) == 1:
                break
            deleted, changed = self.scripts("forget", keys, args)
            done.update(bytes_to_str(d) for d in deleted)
            ids = [bytes_to_str(c) for c in changed]
            if not ids:
                break
        return done

    def _retry_dead_ids(self, ids: list[str]) -> set[str]:
        done: set[str] = set()
        for k, held in self._located("dead_jobs", ids).items():
            moved = self._retry_dead_in(k, held)
            if moved and not k.is_home:  # the home ready hint, beside the copy's (cluster)
                self.client.sadd(self.keys.home.ready, queue_of(k))
            done |= moved
        return done

    def _retry_dead_in(self, k: Keys, ids: list[str]) -> set[str]:
        records = self.client.hmget(k.dead_jobs, ids)
        now = now_s(self.client)
        keys: list[str] = []
        args: list[Any] = []
        for job_id, raw in zip(ids, records, strict=True):
            if raw is None:
                continue
            _meta, queue, payload = split_record(raw)
            keys.append(k.queue_level(queue, level(payload_priority(payload),
                                                   self.settings.priority_steps)))
            args += [job_id, hashlib.sha1(raw).hexdigest(), _manual_retry_payload(payload, now)]
        if not keys:
            return set()
        done = self.scripts("dead_retry", [k.dead, k.dead_jobs, k.ready, k.queues,
                                           *index_keys(k), *keys],
                            [k.wake_channel, k.queue(""), index_ttl_ms(self.settings), *args])
        return {bytes_to_str(d) for d in done}

    def _dead_ids(self, name: str | None) -> Iterator[list[str]]:
        """Ids of dead jobs (of one job name), oldest first (in each copy), in chunks."""
        for k in copies(self.client, self.keys):
            ids = [bytes_to_str(i) for i in self.client.zrange(k.dead, 0, -1)]
            for i in range(0, len(ids), CHUNK):
                chunk = ids[i:i + CHUNK]
                if name is not None:
                    records = self.client.hmget(k.dead_jobs, chunk)
                    chunk = [j for j, raw in zip(chunk, records, strict=True)
                             if raw is not None and self._name_of(raw) == name]
                if chunk:
                    yield chunk

    @staticmethod
    def _name_of(raw: bytes) -> str:
        meta, queue, payload = split_record(raw)
        if meta.get("name"):
            return str(meta["name"])
        return _job_name(meta, queue, _decode_message(payload))

    def _page(self, zset: str, records: str, offset: int, limit: int, name: str | None,
              newest_first: bool, build: Callable[[str, float, bytes], T]) -> Page[T]:
        """One page of a set (``zset``/``records``: Keys attributes) in set order: of
        the one copy on one node; on a cluster the copies' pages merged by score."""
        parts = copies(self.client, self.keys)
        if len(parts) == 1:
            return self._page_in(getattr(parts[0], zset), getattr(parts[0], records), offset,
                                 limit, name, newest_first, build)
        offset, limit = max(0, offset), max(0, limit)
        # Each copy's first offset + limit entries (all matches, with a name) hold the
        # page; the same order as one set's: by score, then by id.
        if name is None:
            found = per_copy(self.client, parts, lambda p, k: (
                p.zcard(getattr(k, zset)),
                p.zrange(getattr(k, zset), 0, offset + limit - 1, desc=newest_first,
                         withscores=True) if limit else p.zcard(getattr(k, zset))))
            total = sum(int(n) for n, _ in found)
            entries = [(float(sc), bytes_to_str(i), k) for k, (_, got) in zip(parts, found,
                                                                             strict=True)
                       if limit for i, sc in got]
        else:
            entries, total = [], 0
            for k in parts:
                for job_id, score, _raw in self._matching(k, zset, records, name,
                                                          newest_first):
                    entries.append((score, job_id, k))
            total = len(entries)
        entries.sort(key=lambda e: (e[0], e[1]), reverse=newest_first)
        entries = entries[offset:offset + limit]
        wanted: dict[Keys, list[str]] = {}
        for _, job_id, k in entries:
            wanted.setdefault(k, []).append(job_id)
        by_copy = list(wanted)
        raws = per_copy(self.client, by_copy, lambda p, k: p.hmget(getattr(k, records),
                                                                    wanted[k]))
        raw_of = {(k, i): r for k, (got,) in zip(by_copy, raws, strict=True)
                  for i, r in zip(wanted[k], got, strict=True)}
        items = [build(job_id, score, raw_of[(k, job_id)]) for score, job_id, k in entries
                 if raw_of.get((k, job_id)) is not None]
        return Page(items=items, total=total, offset=offset, limit=limit)

    def _matching(self, k: Keys, zset: str, records: str, name: str,
                  newest_first: bool) -> Iterator[tuple[str, float, bytes]]:
        """(id, score, record) of every job of the job name ``name`` in a copy's set,
        read in chunks."""
        start = 0
        while True:
            entries = self.client.zrange(getattr(k, zset), start, start + CHUNK - 1,
                                         desc=newest_first, withscores=True)
            if not entries:
                return
            start += CHUNK
            ids = [bytes_to_str(i) for i, _ in entries]
            for job_id, (_, score), raw in zip(ids, entries,
                                              self.client.hmget(getattr(k, records), ids),
                                              strict=True):
                if raw is not None and self._name_of(raw) == name:
                    yield job_id, float(score), raw

    def _page_in(self, zkey: str, hkey: str, offset: int, limit: int, name: str | None,
              newest_first: bool, build: Callable[[str, float, bytes], T]) -> Page[T]:
        offset, limit = max(0, offset), max(0, limit)
        if not limit:
            return Page(items=[], total=int(self.client.zcard(zkey)), offset=offset, limit=0)
        if name is None:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.zcard(zkey)
                pipe.zrange(zkey, offset, offset + limit - 1, desc=newest_first,
                            withscores=True)
                total, entries = pipe.execute()
            if not entries:
                return Page(items=[], total=int(total), offset=offset, limit=limit)
            ids = [bytes_to_str(i) for i, _ in entries]
            records = self.client.hmget(hkey, ids)
            items = [build(i, s, r) for (i, (_, s)), r in zip(zip(ids, entries, strict=True),
                                                               records, strict=True)
                     if r is not None]
            return Page(items=items, total=int(total), offset=offset, limit=limit)
        # Filtered: read the set in chunks, count every match, keep the page.
        total, items, start = 0, [], 0
        while True:
            entries = self.client.zrange(zkey, start, start + CHUNK - 1, desc=newest_first,
                                         withscores=True)
            if not entries:
                break
            start += CHUNK
            ids = [bytes_to_str(i) for i, _ in entries]
            for job_id, (_, score), raw in zip(ids, entries, self.client.hmget(hkey, ids),
                                              strict=True):
                if raw is None or self._name_of(raw) != name:
                    continue
                if offset <= total < offset + limit:
                    items.append(build(job_id, score, raw))
                total += 1
        return Page(items=items, total=total, offset=offset, limit=limit)

    def _scheduled_job(self, job_id: str, score: float, raw: bytes) -> ScheduledJob:
        meta, queue, payload = split_record(raw)
        message = _decode_message(payload)
        headers = _headers(message)
        args, kwargs = _body_args(message)
        scheduled_at = meta.get("scheduled_at")
        return ScheduledJob(
            id=job_id,
            name=_job_name(meta, queue, message),
            task_id=_str_or_none(headers.get("id")) or meta.get("task_id"),
            queue=queue,
            args=args,
            kwargs=kwargs,
            due_at=score / 1000,
            scheduled_at=scheduled_at / 1000 if isinstance(scheduled_at, int | float) else None,
            retry=bool(meta.get("retry")),
            attempt=_int(meta.get("attempt") or headers.get("retries")),
            error=meta.get("error"),
            exc_type=meta.get("exc_type"),
            traceback=meta.get("traceback"),
            eta=_str_or_none(headers.get("eta")),
            expires=_str_or_none(headers.get("expires")),
        )

    def _dead_job(self, job_id: str, score: float, raw: bytes,
                  with_payload: bool = False) -> DeadJob:
        meta, queue, payload = split_record(raw)
        message = _decode_message(payload)
        headers = _headers(message)
        args, kwargs = (meta["args"], meta["kwargs"]) if "args" in meta else _body_args(message)
        attempts = meta.get("attempts")
        if attempts is None and "retries" in headers:
            attempts = _int(headers.get("retries")) + 1
        return DeadJob(
            id=job_id,
            name=_job_name(meta, queue, message),
            task_id=meta.get("task_id") or _str_or_none(headers.get("id")),
            queue=queue,
            reason=str(meta.get("reason", "")),
            error=str(meta.get("error", "")),
            exc_type=meta.get("exc_type"),
            exc_message=meta.get("exc_message"),
            traceback=meta.get("traceback"),
            args=args,
            kwargs=kwargs,
            attempts=attempts,
            pool=meta.get("pool"),
            hostname=meta.get("hostname"),
            failed_at=score / 1000,
            manual_retries=_int(headers.get(MANUAL_RETRIES_HEADER)),
            payload=payload if with_payload else None,
            fair_key=message_fair_key(message),
        )

    # --- dashboard/CLI facade ---
    # What the dashboard (celery_ext.web) and `celery ext` need beyond the above.

    #: The Celery app, when built with :meth:`for_app`: :meth:`job` reads finished jobs
    #: from its result backend.
    app: Any = None

    @classmethod
    def for_app(cls, app: Any) -> Client:
        """Like :meth:`from_app`, keeping ``app`` for :meth:`job`; fails within seconds
        (one connection retry) when Redis is down."""
        cluster = _cluster_client(app)
        if cluster is not None:
            client = cls(cluster, Settings.load(app.conf.broker_transport_options))
            client.app = app
            return client
        with app.connection_for_write() as conn:
            channel = conn.channel()
            try:
                if not hasattr(channel, "settings"):
                    raise ValueError(f"celery_ext: {app.main!r} does not use the celery-ext:// "
                                     "broker transport")
                client = cls(channel.new_client(), channel.settings)
            finally:
                channel.close()
        client.app = app
        return client

    def ping(self) -> bool:
        return bool(self.client.ping())

    def server_time(self) -> float:
        """Redis server time, seconds."""
        return now_s(self.client)

    def memory_warning(self) -> str | None:
        """Why the server's ``maxmemory-policy`` can lose jobs, or None (``noeviction``,
        or INFO refused)."""
        from celery_ext.store.memory import eviction_warning

        try:
            return eviction_warning(self.client)
        except redis.ResponseError:
            return None

    def totals(self) -> dict[str, int]:
        """Processed/failed/retried counters over all job queues."""
        return self.state.totals()

    def queue_count(self, prefix: str | None = None) -> int:
        """How many job queues (whose name starts with ``prefix``) exist."""
        return sum(1 for n in self.state.queue_names() if not prefix or n.startswith(prefix))

    def job(self, job_id: str, deep: bool = True) -> JobStatus:
        """One job's status by its id (see :mod:`celery_ext.status`)."""
        return JobLookup(self.client, self.settings, self.app).status(job_id, deep)

    def reap(self, force: bool = False) -> ReapResult:
        """One reaper pass now: requeue the jobs of dead worker pools, each judged by
        its own ``dead_after``. Pools that look dead are first watched for two of their
        heartbeat intervals (and a second) of steady Redis, so a Redis outage or stall
        does not pass for their death; ``force=True`` skips that (see
        :meth:`celery_ext.reaper.Reaper.reap_now`)."""
        return Reaper(self.client, self.settings).reap_now(force=force)

    # -- periodic jobs (celery_ext.periodic) ------------------------------------------------
    def periodic(self) -> list[PeriodicEntry]:
        """Every periodic job entry: schedule, next and last run, last outcome, paused."""
        return entry_rows(self.client, self.keys, self.app)

    def pause_periodic(self, name: str) -> bool | None:
        """Pause an entry (its due times pass without runs); None if there is none."""
        return set_paused(self.client, self.keys, name, True)

    def resume_periodic(self, name: str) -> bool | None:
        """Resume a paused entry from its next due time; None if there is none."""
        return set_paused(self.client, self.keys, name, False)

    def run_periodic_now(self, name: str) -> str | None:
        """Enqueue one run of an entry now (needs the app: :meth:`for_app`); its job id,
        or None when the app's ``beat_schedule`` has no such entry."""
        if self.app is None:
            raise ValueError("celery_ext: run-now needs the Celery app (Client.for_app)")
        return run_now(self.app, self.client, self.keys, name)
    # --- search in the sets, and the history (see celery_ext.search, celery_ext.history) ---

    def search(self, kind: str, filters: Filters, cursor: str | None = None,
               limit: int = 50) -> SearchPage:
        """Jobs of the ``kind`` set ("dead", "scheduled", "retry") that match, from
        ``cursor`` (None: the start); the page's ``cursor`` goes on (None: no more)."""
        parts = copies(self.client, self.keys)
        if len(parts) > 1:
            return self._search_copies(parts, kind, filters, parse_cursor(cursor),
                                       max(1, limit))
        search = SetSearch(self.client, self.scripts, self.keys, kind)
        matches, nxt, scanned = search.page(filters, parse_cursor(cursor), max(1, limit))
        items = self._built(kind, {self.keys: [i for i, _ in matches]},
                            [(s, i, self.keys) for i, s in matches])
        return SearchPage(items=items, cursor=f"{nxt[0]}:{nxt[1]}" if nxt else None,
                          scanned=scanned)

    def _built(self, kind: str, wanted: dict[Keys, list[str]],
               matches: list[tuple[float, str, Keys]]) -> list[Any]:
        """The jobs of ``matches`` (score, id, copy), read from their copies' records."""
        by_copy = [k for k in wanted if wanted[k]]
        records = "dead_jobs" if kind == "dead" else "scheduled_jobs"
        raws = per_copy(self.client, by_copy, lambda p, k: p.hmget(getattr(k, records),
                                                                    wanted[k]))
        raw_of = {(k, i): r for k, (got,) in zip(by_copy, raws, strict=True)
                  for i, r in zip(wanted[k], got, strict=True)}
        build: Callable[[str, float, bytes], Any] = (
            self._dead_job if kind == "dead" else self._scheduled_job)
        return [build(i, score, raw_of[(k, i)]) for score, i, k in matches
                if raw_of.get((k, i)) is not None]

    def _search_copies(self, parts: list[Keys], kind: str, filters: Filters,
                       start: tuple[str, int] | None, limit: int) -> SearchPage:
        """:meth:`search` over several copies (a cluster): each copy's matches from the
        cursor's score, merged in set order (score, then id). The cursor's skip counts
        the matches at its score already returned. A copy that stopped on the scan
        budget bounds the page: only matches before its stopping score are sure."""
        newest = kind == "dead"
        skip = start[1] if start else 0
        want = limit + skip
        found: list[tuple[float, str, Keys]] = []
        bound: float | None = None
        more = False
        scanned = 0
        for k in parts:
            search = SetSearch(self.client, self.scripts, k, kind)
            matches, nxt, n = search.page(filters, (start[0], 0) if start else None, want)
            scanned += n
            found += [(score, i, k) for i, score in matches]
            if nxt is not None and len(matches) < want:  # stopped by the scan budget
                b = float(nxt[0])
                bound = b if bound is None else (max(bound, b) if newest else min(bound, b))
            elif nxt is not None:
                more = True
        found.sort(key=lambda e: (e[0], e[1]), reverse=newest)
        if bound is not None:
            found = [e for e in found if (e[0] > bound if newest else e[0] < bound)]
        at = float(start[0]) if start else None
        dropped = 0
        while found and dropped < skip and found[0][0] == at:
            found.pop(0)
            dropped += 1
        page, rest = found[:limit], found[limit:]
        cursor = None
        if page and (rest or more or bound is not None):
            last = page[-1][0]
            seen = sum(1 for e in page if e[0] == last) + (dropped if last == at else 0)
            cursor = f"{last:.17g}:{seen}"
        elif bound is not None:
            cursor = f"{bound:.17g}:0"
        wanted: dict[Keys, list[str]] = {}
        for _, i, k in page:
            wanted.setdefault(k, []).append(i)
        return SearchPage(items=self._built(kind, wanted, page), cursor=cursor,
                          scanned=scanned)

    def count_matching(self, kind: str, filters: Filters) -> int:
        """How many jobs of the ``kind`` set match (scans the set in chunks)."""
        return sum(SetSearch(self.client, self.scripts, k, kind).count(filters)
                   for k in copies(self.client, self.keys))

    def retry_matching(self, kind: str, filters: Filters) -> int:
        """Retry every matching dead job (as :meth:`retry_dead`), or make every matching
        scheduled job or retry due now; returns how many."""
        return sum(SetSearch(self.client, self.scripts, k, kind).act(
            filters, self._retry_dead_ids if kind == "dead" else self._run_now)
            for k in copies(self.client, self.keys))

    def delete_matching(self, kind: str, filters: Filters) -> int:
        """Delete every matching job of the ``kind`` set; returns how many."""
        pair = ("dead_jobs", "dead", "dead") if kind == "dead" else (
            "scheduled_jobs", "scheduled", "retry")
        return sum(SetSearch(self.client, self.scripts, k, kind).act(
            filters, lambda ids: self._forget(*pair, ids))
            for k in copies(self.client, self.keys))

    def _run_now(self, ids: list[str]) -> set[str]:
        """Make scheduled jobs or retries due now, in the copy holding each, then wake
        the requeuers (a cluster's pipeline cannot carry the PUBLISH)."""
        done: set[str] = set()
        for k, held in self._located("scheduled_jobs", ids).items():
            with self.client.pipeline(transaction=True) as pipe:
                for job_id in held:
                    pipe.zadd(k.scheduled, {job_id: 0}, xx=True, ch=True)
                    pipe.zadd(k.retry, {job_id: 0}, xx=True, ch=True)
                changed = pipe.execute()
            done |= {i for n, i in enumerate(held) if changed[2 * n] or changed[2 * n + 1]}
        self.client.publish(self.keys.schedule_channel, "0")
        return done

    def history(self, window: str = "1h") -> Series:
        """Per-minute (per-hour for the long windows) counts, runtime percentiles and
        queue sizes over ``window`` ("1h", "6h", "24h", "7d", "30d")."""
        return HistoryReader(self.client, self.settings).series(window, self.server_time())

    def runtimes(self, window: str = "1h") -> list[Runtime]:
        """Per job name: counts and runtime p50/p95/p99 over ``window``."""
        return HistoryReader(self.client, self.settings).runtimes(window, self.server_time())


class SearchPage(TypedDict):
    items: list[Any]  # DeadJob or ScheduledJob
    cursor: str | None
    scanned: int


# Imports of the dashboard/CLI facade above, kept with it so it stays one appended block.
from celery_ext.admin.job_status import JobLookup, JobStatus  # noqa: E402
from celery_ext.admin.search import Filters, SetSearch, parse_cursor  # noqa: E402
from celery_ext.store.clock import now_s  # noqa: E402
from celery_ext.store.history import HistoryReader, Runtime, Series  # noqa: E402
from celery_ext.worker.periodic import PeriodicEntry, entry_rows, run_now, set_paused  # noqa: E402
from celery_ext.worker.reaper import Reaper, ReapResult  # noqa: E402


def _cluster_client(app: Any) -> Any:
    """A RedisCluster client when ``app``'s broker is a cluster (transport option
    ``cluster``), else None: the transport itself does not run on a cluster yet, so the
    client is built from the URL and options (``broker_use_ssl`` for TLS) without it."""
    conf = app.conf
    urls = [u for u in (conf.broker_write_url, conf.broker_url) if isinstance(u, str) and u]
    config = cluster_config(urls[:1], conf.broker_transport_options)
    if config is None:
        return None
    params: dict[str, Any] = {"socket_timeout": Settings.load(
        conf.broker_transport_options).reply_timeout}
    if isinstance(conf.broker_use_ssl, dict):
        params.update(conf.broker_use_ssl)
    return cluster_client(config, params)
