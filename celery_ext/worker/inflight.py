"""A pool's in-flight record (``{ns}:inflight:<pool id>``) and the moves out of it.

The record holds every job the pool fetched and has not finished: fetch puts a job
in, atomically with popping it from its queue. It leaves by one of these moves,
each one script: ack (done), requeue (back to the front of its queue's list of its
priority level), throttle (the same, holding its fair key or queue: ``Throttled``), dead
(to the dead set, ``dead.dead_letter``) or recover (counted: by
the reaper for a dead pool, or when a prefork child died, ``recover_tags``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from celery_ext.config import DEFAULT_PRIORITY_STEPS, Settings
from celery_ext.options.priority import level, payload_priority
from celery_ext.options.unique import MODE_HEADER, finished_lock
from celery_ext.store.compact import headers_of
from celery_ext.store.copies import run_scripts
from celery_ext.store.dead_set import notify_dead
from celery_ext.store.job_index import index_keys, index_ttl_ms
from celery_ext.store.keys import STAT_POISON_PILLS, STAT_RECOVERED, Keys
from celery_ext.store.revoked import copy_revokes
from celery_ext.store.scripts import Scripts

logger = logging.getLogger("celery_ext.worker.inflight")


def lists_of(client: Any, keys: Keys, steps: Sequence[int], inflight_key: str,
             tags: list[str]) -> list[tuple[str, str]]:
    """``(tag, list key)`` of the tags still in a record, in the order to push them
    back: the first delivered last, so it is the next fetched. The list is the one of
    the job's queue and priority level, read from its payload (:mod:`.priority`). (A
    script may only touch the keys it is given, so the records are read first; the
    scripts re-check the queue.)"""
    return pairs_of(keys, steps, tags, client.hmget(inflight_key, tags) if tags else [])


def pairs_of(keys: Keys, steps: Sequence[int], tags: list[str],
             records: Sequence[bytes | None]) -> list[tuple[str, str]]:
    """:func:`lists_of` for records already read (``HMGET`` of ``tags``): a caller that
    reads several copies pipelines the reads."""
    pairs = []
    for tag, rec in zip(tags, records, strict=True):
        if rec:
            queue, _, payload = rec.partition(b"\n")
            pairs.append((tag, keys.queue_level(
                bytes_to_str(queue), level(payload_priority(payload), steps))))
    pairs.reverse()
    return pairs


def locks_of(keys: Keys, records: Sequence[bytes | None]) -> list[str]:
    """The unique locks of the jobs locked until finished among in-flight ``records``
    (HMGET replies): a recovery that dead-letters one of them releases its lock."""
    out = set()
    for rec in records:
        if rec and MODE_HEADER.encode() in rec:
            _, _, payload = rec.partition(b"\n")
            digest = finished_lock(headers_of(payload))
            if digest is not None:
                out.add(keys.unique(digest))
    return sorted(out)


class InflightRecord:
    """One pool's in-flight record, through one client.

    On a cluster the record is one hash per job queue, in the queue's copy of the
    layout (``Keys.of``): the pool joins a copy before its first fetch from it
    (:meth:`join`), and every move goes to the copies its tags are in (:meth:`locate`).
    On one node there is one copy and one hash."""

    def __init__(self, client: Any, keys: Keys, pool_id: str,
                 priority_steps: Sequence[int] = DEFAULT_PRIORITY_STEPS,
                 index_ttl: int = 0) -> None:
        self.client = client
        self.keys = keys
        self.priority_steps = priority_steps
        self.index_ttl = index_ttl  # the job index's TTL in ms, 0 = off (job_index.py)
        self.pool_id = pool_id
        self.key = keys.inflight(pool_id)
        self.scripts = Scripts(client)
        #: Cluster: the copies this pool joined (whose ``pools`` name it), and the
        #: job queue of each tag fetched and not yet finished.
        self._joined: set[Keys] = set()
        self._queue_of: dict[str, str] = {}
        #: Cluster: the copies fetched from since the record was last read whole.
        self._touched: set[Keys] = set()
        #: The unique lock digest of each job locked until finished that this process
        #: delivered and has not finished: its ack releases the lock (``ack_call``).
        self._locks: dict[str, str] = {}

    # -- where the record is (one copy on one node) -----------------------------------
    def copies(self) -> list[Keys]:
        return list(self._joined) if self.keys.cluster else [self.keys]

    def join(self, copies: Sequence[Keys]) -> None:
        """Cluster: add the pool to the ``pools`` of the copies it has not joined yet
        (one pipeline), before it fetches from them: fetch refuses a pool that is not
        there, which is how the reaper's recovery of a copy reaches a live pool."""
        if not self.keys.cluster:
            return
        self._touched.update(copies)
        new = [k for k in copies if k not in self._joined]
        if not new:
            return
        with self.client.pipeline(transaction=False) as pipe:
            for k in new:
                pipe.zadd(k.pools, {self.pool_id: 0})
            pipe.execute()
        # Then the home registry, after the copies: a reader that forgot a queue while
        # this pool joined it sees the join or this (store/copies.forget_queues).
        queues = [k.copy_queue for k in new if k.copy_queue is not None]
        if queues:
            self.client.sadd(self.keys.home.queues, *queues)
        # Then the live revokes into the new copies: a queue first seen after a revoke
        # has no copy of it, and its fetches read only its copy (store/revoked.py).
        copy_revokes(self.client, self.keys, new)
        self._joined.update(new)

    def forget_joins(self) -> None:
        """The pool was declared dead somewhere: join every copy again before fetching."""
        self._joined.clear()

    def fetched(self, tag: str, queue: str) -> None:
        if self.keys.cluster:
            self._queue_of[tag] = queue

    def locked(self, tag: str, digest: str) -> None:
        """A delivered job is locked until finished by the lock ``digest``."""
        self._locks[tag] = digest

    def finished(self, tags: Sequence[str]) -> None:
        for tag in tags:
            self._locks.pop(tag, None)
        if self.keys.cluster:
            for tag in tags:
                self._queue_of.pop(tag, None)

    def locate(self, tags: Sequence[str]) -> dict[Keys, list[str]]:
        """``tags`` by the copy whose record holds them (one copy on one node). A tag
        whose queue this process does not know is looked for in every joined copy."""
        if not self.keys.cluster:
            return {self.keys: list(tags)} if tags else {}
        out: dict[Keys, list[str]] = {}
        unknown = []
        for tag in tags:
            queue = self._queue_of.get(tag)
            if queue is None:
                unknown.append(tag)
            else:
                out.setdefault(self.keys.of(queue), []).append(tag)
        copies = self.copies()
        if unknown and copies:
            with self.client.pipeline(transaction=False) as pipe:
                for k in copies:
                    pipe.hmget(k.inflight(self.pool_id), unknown)
                for k, recs in zip(copies, pipe.execute(), strict=True):
                    out.setdefault(k, []).extend(t for t, r in zip(unknown, recs, strict=True)
                                                 if r)
        return {k: ts for k, ts in out.items() if ts}

    # -- moves ----------------------------------------------------------------------------
    def ack_call(self, tags: list[str], keys: Keys | None = None
                 ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the ``ack`` script for ``tags`` of one copy (tags last); the
        unique locks of the jobs locked until finished among them go last in KEYS."""
        k = keys or self.keys
        locks = {k.unique(d) for d in (self._locks.get(t) for t in tags) if d is not None}
        return ([k.inflight(self.pool_id), k.redelivery, k.running, k.limits, k.ready,
                 *index_keys(k), *sorted(locks)],
                [k.wake_channel, self.index_ttl, k.cursor_prefix, self.pool_id, *tags])

    def ack(self, tags: list[str]) -> int:
        """Drop finished jobs from the record; tags no longer in it are ignored."""
        # One call per copy holding some of them (one on one node), one pipeline per
        # master on a cluster.
        replies = run_scripts(self.client, self.scripts,
                              [("ack", *self.ack_call(some, k))
                               for k, some in self.locate(tags).items()])
        self.finished(tags)
        return sum(int(r) for r in replies)

    def tags(self) -> list[str]:
        """Every tag in the record. On a cluster the record is read in the copies it
        can have jobs in: those fetched from since the last read, and those of the
        jobs this process knows of (an idle pool reads nothing)."""
        if not self.keys.cluster:
            return [bytes_to_str(t) for t in self.client.hkeys(self.key)]
        copies = list(self._touched | {self.keys.of(q) for q in set(self._queue_of.values())})
        self._touched.clear()
        if not copies:
            return []
        out = []
        with self.client.pipeline(transaction=False) as pipe:
            for k in copies:
                pipe.hgetall(k.inflight(self.pool_id))
            for recs in pipe.execute():
                for tag, rec in recs.items():
                    tag = bytes_to_str(tag)
                    self._queue_of.setdefault(tag, bytes_to_str(rec.partition(b"\n")[0]))
                    out.append(tag)
        return out

    def requeue(self, tags: list[str]) -> list[str]:
        """Move ``tags`` (in delivery order) to the front of their job queues, the
        first delivered first fetched again. Reads the queues first (a script may only
        touch the keys it is given), then moves atomically; tags no longer in the
        record are skipped. Returns the tags moved."""
        if not tags:
            return []
        moved: list[str] = []
        for k, some in self.locate(tags).items():
            key = k.inflight(self.pool_id)
            pairs = lists_of(self.client, k, self.priority_steps, key, some)
            done = self.scripts(
                "requeue",
                [key, k.ready, k.redelivery, k.running, *index_keys(k), *(q for _, q in pairs)],
                [k.wake_channel, k.queue(""), self.index_ttl, *(t for t, _ in pairs)],
            )
            moved += [bytes_to_str(t) for t in done]
            if done and k.copy_queue is not None:  # cluster: the home hint of ready queues
                self.client.sadd(self.keys.ready, k.copy_queue)
        self.finished(moved)
        return moved

    def throttle(self, tag: str, hold_us: int, job: bytes = b"") -> str | None:
        """Move ``tag`` to the front of its job queue and hold its fair key (or its job
        queue) ``hold_us`` in all pools (``throttle.lua``). ``job``: the job as
        "<queue>\n<payload>", pushed when the tag is no longer in the record (acked when
        it started). Returns "key" or "queue" (what is held), or None (nothing moved)."""
        queue = self._queue_of.get(tag) or bytes_to_str(job.partition(b"\n")[0]) or None
        k = self.keys.of(queue) if queue else next(iter(self.locate([tag])), self.keys)
        key = k.inflight(self.pool_id)
        pairs = pairs_of(k, self.priority_steps, [tag], [self.client.hget(key, tag) or job])
        if not pairs:
            return None
        held = self.scripts(
            "throttle", [key, k.ready, k.running, k.rate_tat, *index_keys(k), pairs[0][1]],
            [k.wake_channel, k.queue(""), self.index_ttl, tag, hold_us, job])
        if held and k.copy_queue is not None:  # cluster: the home hint of ready queues
            self.client.sadd(self.keys.ready, k.copy_queue)
        self.finished([tag])
        return bytes_to_str(held) if held else None

    def leave(self) -> None:
        """Cluster, warm shutdown after the return: leave every joined copy, dropping
        its empty record from the copy's ``inflight_pools`` (a record still holding jobs
        stays listed there, for the reaper)."""
        copies = self.copies()
        if not self.keys.cluster or not copies:
            return
        with self.client.pipeline(transaction=False) as pipe:
            for k in copies:
                pipe.hlen(k.inflight(self.pool_id))
            left = pipe.execute()
        with self.client.pipeline(transaction=False) as pipe:
            for k, n in zip(copies, left, strict=True):
                pipe.zrem(k.pools, self.pool_id)
                if not int(n):
                    pipe.srem(k.inflight_pools, self.pool_id)
            pipe.execute()
        self._joined.clear()


def _count_recoveries(client: Any, keys: Keys, recovered: int, poison_pills: int) -> None:
    """Add to the counters the metrics read: jobs the reaper requeued from dead pools,
    and jobs dead-lettered after too many recoveries (either mode). Written after the
    script, not in it: a count is observational, so a failure to write it is logged
    and the move it counts (already done) is reported as done."""
    if not (recovered or poison_pills):
        return
    try:
        with client.pipeline(transaction=False) as pipe:
            if recovered:
                pipe.hincrby(keys.stats, STAT_RECOVERED, recovered)
            if poison_pills:
                pipe.hincrby(keys.stats, STAT_POISON_PILLS, poison_pills)
            pipe.execute()
    except redis.RedisError as exc:
        logger.warning("celery_ext: could not count %d recovered job(s): %s",
                       recovered + poison_pills, exc)


def recover_call(keys: Keys, settings: Settings, pool_id: str, pairs: list[tuple[str, str]],
                 *, mode: str, deadline_ms: int = 0, reason: str = "worker lost",
                 locks: Sequence[str] = ()) -> tuple[str, list[str], list[Any]]:
    """Name, KEYS and ARGV of one ``recover`` call on the copy ``keys`` for ``pairs``
    (:func:`pairs_of`); ``locks`` (:func:`locks_of`) are released with the jobs of
    theirs that go to the dead set."""
    return ("recover",
            [keys.inflight(pool_id), keys.pools, keys.pool(pool_id), keys.inflight_pools,
             keys.ready, keys.redelivery, keys.running, keys.dead, keys.dead_jobs,
             *index_keys(keys), *(q for _, q in pairs), *locks],
            [pool_id, mode, deadline_ms, keys.wake_channel, keys.queue(""),
             settings.max_recoveries, settings.dead_max_size, reason, index_ttl_ms(settings),
             keys.cursor_prefix, *(t for t, _ in pairs)])


def recover_reply(client: Any, keys: Keys, mode: str, reply: Any
                  ) -> tuple[bool, list[str], list[str]]:
    """(done, requeued tags, dead tags) of a ``recover`` reply, counted in ``keys``'
    stats."""
    status, requeued, dead = reply
    _count_recoveries(client, keys, len(requeued) if mode == "pool" else 0, len(dead))
    dead_tags = [bytes_to_str(t) for t in dead]
    notify_dead(client, keys, dead_tags)  # poison pills: their chords fail (results/)
    return bool(status), [bytes_to_str(t) for t in requeued], dead_tags


def recover_tags(client: Any, settings: Settings, pool_id: str, tags: list[str], *,
                 mode: str, deadline_ms: int = 0, reason: str = "worker lost",
                 scripts: Scripts | None = None, keys: Keys | None = None
                 ) -> tuple[bool, list[str], list[str]]:
    """Run the ``recover`` script for some of a pool's in-flight tags, in the copy
    ``keys`` (default: the home copy; on a cluster a job queue's copy holds the pool's
    record of that queue, ``Keys.of``).

    Returns (done, requeued tags, dead tags); done is False when the pool turned out
    to be alive ("pool" mode re-checks the heartbeat atomically).
    """
    keys = keys or Keys.for_settings(settings)
    records = client.hmget(keys.inflight(pool_id), tags) if tags else []
    pairs = pairs_of(keys, settings.priority_steps, tags, records)
    scripts = scripts or Scripts(client)
    reply = scripts(*recover_call(keys, settings, pool_id, pairs, mode=mode,
                                  deadline_ms=deadline_ms, reason=reason,
                                  locks=locks_of(keys, records)))
    return recover_reply(client, keys, mode, reply)
