"""The scheduled, retry and dead sets as a person steers them: pages, and actions on jobs.

Pages are read in set order (the retry and scheduled sets soonest first, the dead set
newest first); on a cluster each job queue's copy holds its own sets, and a page merges
the copies by score. Every write is one script or one MULTI in the copy that holds the
job, and idempotent: two people pressing "retry" on the same dead job requeue it once
(``dead_retry.lua`` and ``forget.lua`` act only on a record that is still the one read,
by its SHA-1). Deleting a unique job's record releases its unique lock in the same
script. :class:`celery_ext.client.Client` is the facade over this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kombu.utils.encoding import bytes_to_str

from celery_ext.admin.api_types import DeadJob, Page, ScheduledJob
from celery_ext.admin.job_records import dead_job, manual_retry_payload, name_of, scheduled_job
from celery_ext.config import Settings
from celery_ext.options.priority import level, payload_priority
from celery_ext.options.unique import lock_of
from celery_ext.store.clock import now_s
from celery_ext.store.copies import copies, per_copy, queue_of
from celery_ext.store.dead_set import split_record
from celery_ext.store.job_index import index_keys, index_ttl_ms
from celery_ext.store.keys import Keys
from celery_ext.store.revoked import lift, revoked_task_id
from celery_ext.store.scripts import Scripts

T = TypeVar("T")

#: Jobs read (or moved) per round trip when listing with a filter or acting on all.
CHUNK = 200
#: A set's records hash and the two zsets a job of it may be in (Keys attributes), by
#: the kind of set a search or bulk action names.
RECORDS = {"dead": ("dead_jobs", "dead", "dead"),
           "scheduled": ("scheduled_jobs", "scheduled", "retry"),
           "retry": ("scheduled_jobs", "scheduled", "retry")}


class JobSets:
    """Pages of, and actions on, one namespace's scheduled, retry and dead sets."""

    def __init__(self, client: Any, settings: Settings, scripts: Scripts | None = None) -> None:
        self.client: Any = client  # sync client (redis-py types replies as unions)
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.scripts = scripts or Scripts(client)

    # -- pages ---------------------------------------------------------------------------
    def scheduled(self, offset: int, limit: int, name: str | None) -> Page[ScheduledJob]:
        return self.page("scheduled", "scheduled_jobs", offset, limit, name,
                         newest_first=False, build=scheduled_job)

    def retries(self, offset: int, limit: int, name: str | None) -> Page[ScheduledJob]:
        return self.page("retry", "scheduled_jobs", offset, limit, name,
                         newest_first=False, build=scheduled_job)

    def dead(self, offset: int, limit: int, name: str | None) -> Page[DeadJob]:
        return self.page("dead", "dead_jobs", offset, limit, name,
                         newest_first=True, build=dead_job)

    def dead_job(self, job_id: str) -> DeadJob | None:
        for score, raw in self._each(lambda p, k: (p.zscore(k.dead, job_id),
                                                   p.hget(k.dead_jobs, job_id))):
            if score is not None and raw is not None:
                return dead_job(job_id, float(score), raw, with_payload=True)
        return None

    def built(self, kind: str, matches: list[tuple[float, str, Keys]]) -> list[Any]:
        """The jobs of ``matches`` (score, id, copy) of the ``kind`` set."""
        build: Callable[[str, float, bytes], Any] = dead_job if kind == "dead" else scheduled_job
        return self._read(RECORDS[kind][0], matches, build)

    def _read(self, records: str, entries: list[tuple[float, str, Keys]],
              build: Callable[[str, float, bytes], T]) -> list[T]:
        """``build(id, score, record)`` of each entry (score, id, copy), the records read
        from the copies' ``records`` hashes (a Keys attribute) in one pipeline; an entry
        whose record is gone meanwhile is left out."""
        wanted: dict[Keys, list[str]] = {}
        for _, job_id, k in entries:
            wanted.setdefault(k, []).append(job_id)
        by_copy = list(wanted)
        raws = per_copy(self.client, by_copy, lambda p, k: p.hmget(getattr(k, records),
                                                                    wanted[k]))
        raw_of = {(k, i): r for k, (got,) in zip(by_copy, raws, strict=True)
                  for i, r in zip(wanted[k], got, strict=True)}
        return [build(i, score, raw_of[(k, i)]) for score, i, k in entries
                if raw_of.get((k, i)) is not None]

    def page(self, zset: str, records: str, offset: int, limit: int, name: str | None,
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
            entries = [(score, job_id, k) for k in parts for job_id, score, _raw
                       in self._matching(getattr(k, zset), getattr(k, records), name,
                                         newest_first)]
            total = len(entries)
        entries.sort(key=lambda e: (e[0], e[1]), reverse=newest_first)
        entries = entries[offset:offset + limit]
        items = self._read(records, entries, build)
        return Page(items=items, total=total, offset=offset, limit=limit)

    def _matching(self, zkey: str, hkey: str, name: str, newest_first: bool
                  ) -> Iterator[tuple[str, float, bytes]]:
        """(id, score, record) of every job of the job name ``name`` in a set, in set
        order, read in chunks."""
        start = 0
        while True:
            entries = self.client.zrange(zkey, start, start + CHUNK - 1, desc=newest_first,
                                         withscores=True)
            if not entries:
                return
            start += CHUNK
            ids = [bytes_to_str(i) for i, _ in entries]
            for job_id, (_, score), raw in zip(ids, entries, self.client.hmget(hkey, ids),
                                              strict=True):
                if raw is not None and name_of(raw) == name:
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
        items, total = [], 0
        for job_id, score, raw in self._matching(zkey, hkey, name, newest_first):
            if offset <= total < offset + limit:
                items.append(build(job_id, score, raw))
            total += 1
        return Page(items=items, total=total, offset=offset, limit=limit)

    # -- actions -------------------------------------------------------------------------
    def retry_all_dead(self, name: str | None) -> int:
        return sum(len(self.retry_dead_ids(chunk)) for chunk in self._dead_ids(name))

    def delete_all_dead(self, name: str | None) -> int:
        return sum(len(self.forget("dead", chunk)) for chunk in self._dead_ids(name))

    def run_now(self, ids: list[str]) -> set[str]:
        """Make scheduled jobs or retries due now, in the copy holding each, then wake
        the requeuers (a cluster's pipeline cannot carry the PUBLISH); the ids changed."""
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

    def forget(self, kind: str, ids: list[str]) -> set[str]:
        """Delete jobs of the ``kind`` set ("dead", or "scheduled"/"retry": either of
        the two) with the ``forget`` script, in the copy holding each, releasing each
        unique job's lock; returns the ids deleted."""
        records, first, second = RECORDS[kind]
        done: set[str] = set()
        for k, held in self._located(records, ids).items():
            done |= self._forget_in(k, getattr(k, records), getattr(k, first),
                                    getattr(k, second), held)
        return done

    def retry_dead_ids(self, ids: list[str]) -> set[str]:
        """Move dead jobs to the front of their job queues (:func:`manual_retry_payload`);
        returns the ids moved."""
        done: set[str] = set()
        for k, held in self._located("dead_jobs", ids).items():
            moved = self._retry_dead_in(k, held)
            if moved and not k.is_home:  # the home ready hint, beside the copy's (cluster)
                self.client.sadd(self.keys.home.ready, queue_of(k))
            done |= moved
        return done

    # -- internals -----------------------------------------------------------------------
    def _each(self, read: Callable[[Any, Keys], object]) -> list[list[Any]]:
        """``read(pipe, copy)`` for every copy of the namespace, one pipeline."""
        return per_copy(self.client, copies(self.client, self.keys), read)

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

    def _retry_dead_in(self, k: Keys, ids: list[str]) -> set[str]:
        records = self.client.hmget(k.dead_jobs, ids)
        now = now_s(self.client)
        keys: list[str] = []
        args: list[Any] = []
        lifted: list[str] = []
        for job_id, raw in zip(ids, records, strict=True):
            if raw is None:
                continue
            meta, queue, payload = split_record(raw)
            task_id = revoked_task_id(meta, payload)
            if task_id:
                lifted.append(task_id)
            keys.append(k.queue_level(queue, level(payload_priority(payload),
                                                   self.settings.priority_steps)))
            args += [job_id, hashlib.sha1(raw).hexdigest(),
                     manual_retry_payload(payload, queue, now)]
        if not keys:
            return set()
        lift(self.client, self.keys, lifted)  # (before: its fetch would drop it again)
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
                             if raw is not None and name_of(raw) == name]
                if chunk:
                    yield chunk
