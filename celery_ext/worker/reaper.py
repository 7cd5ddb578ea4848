"""The dead-pool reaper: requeues the in-flight jobs of pools that stopped heartbeating.

Every worker pool runs one (``start()``/``stop()``); a lock makes one pass run at a
time across the cluster. ``reap()`` is the one-shot pass that tests call, and
``reap_now()`` the one ``celery ext reap`` and ``Client.reap()`` run.

Staleness is judged by Redis time only, and by each pool's own ``dead_after`` (the
rule is :mod:`celery_ext.store.liveness`). A Redis outage or stall makes every heartbeat
look old at once, so a pool is only judged by a reaper that has seen Redis answer
steadily for long enough: in a worker, ``dead_after`` of its own contact and the
pool's :attr:`~celery_ext.store.liveness.Liveness.confirm_ms`; in a one-shot process,
``reap_now()`` first watches Redis for the confirm time of the pools that look dead
(``force=True`` skips the watch).

Each tick also trims the job index's finished entries past their TTL, a bounded step
per copy (:meth:`Reaper.trim_index`), so they expire when no later job of their queue
finishes.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings
from celery_ext.store.clock import now_ms
from celery_ext.store.copies import copies, per_copy, queue_of, run_scripts
from celery_ext.store.job_index import trim_finished
from celery_ext.store.keys import STAT_POOLS_REAPED, Keys
from celery_ext.store.liveness import LIVENESS_FIELDS, Liveness
from celery_ext.store.scripts import Scripts
from celery_ext.worker.background import BackgroundLoop
from celery_ext.worker.inflight import (
    locks_of,
    pairs_of,
    recover_call,
    recover_reply,
    recover_tags,
)

logger = logging.getLogger("celery_ext.worker.reaper")

#: Most in-flight jobs moved by one script call (bounds the time Redis is blocked).
RECOVER_CHUNK = 500
#: On a cluster, the heartbeat deadline given to ``recover.lua`` in a job queue's copy:
#: far in the future, so the pool's join of that queue (its score there) counts as
#: stale and the copy's records of a pool declared dead on the home copy are recovered.
JOINED_DEADLINE_MS = 2**52
#: ``reap_now()`` reads Redis' clock this often while it watches for a stall (seconds).
WATCH_POLL = 0.2
#: A reply later than this after the previous one (ms, Redis time, beyond the poll
#: interval) counts as a stall: the watch starts over.
WATCH_GAP_MS = 1000


@dataclass
class ReapResult:
    """What one reaper pass did."""

    dead_pools: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    dead_jobs: list[str] = field(default_factory=list)
    skipped: str = ""
    #: Pools that look dead but were left for a later pass: Redis has not been seen
    #: answering steadily for long enough to tell them from a Redis stall.
    waiting: list[str] = field(default_factory=list)
    #: Seconds ``reap_now()`` watched Redis answer steadily before the pass.
    watched: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.dead_pools or self.requeued or self.dead_jobs)


class Reaper(BackgroundLoop):
    """Finds dead and vanished pools and returns their jobs to the front of their queues."""

    thread_name = "celery_ext-reaper"

    def __init__(self, client: redis.Redis, settings: Settings,
                 own_pool_id: str | None = None) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.scripts = Scripts(client)
        self.own_pool_id = own_pool_id
        BackgroundLoop.__init__(self)
        # Stall guard: Redis time (ms) since which this reaper has reached Redis at
        # every pass without a gap; None until the first successful pass.
        self._steady_since: int | None = None
        self._last_ok: int | None = None
        self.passes = 0
        #: Other pools' timings, read once per pool: a pool writes them when it registers
        #: and never changes them, so a pass reads only the pools it has not seen (one
        #: HMGET per pool, not one per pool per pass: every pool's reaper reading every
        #: other pool's record made the idle commands grow with the square of the pools).
        self._timings: dict[str, Liveness] = {}

    # -- one pass ------------------------------------------------------------------------
    def stale(self, now: int) -> dict[str, Liveness | None]:
        """Pools whose heartbeat is older than their own dead_after (with their timings),
        plus orphans (None): pools that own in-flight jobs but are not registered."""
        beats: Any = self.client.zrange(self.keys.pools, 0, -1, withscores=True)
        ids = [bytes_to_str(p) for p, _ in beats if bytes_to_str(p) != self.own_pool_id]
        timings = self._pool_timings(ids)
        beat_of: dict[str, float] = {bytes_to_str(p): s for p, s in beats}
        result: dict[str, Liveness | None] = {}
        for pool_id in ids:
            liveness = timings[pool_id]
            if liveness.stale(beat_of[pool_id], now):
                result[pool_id] = liveness
        owners = sorted(bytes_to_str(p) for p in self.client.smembers(self.keys.inflight_pools))
        if self.keys.cluster:  # a queue's copy holds the pools owning jobs of that queue
            found = per_copy(self.client, copies(self.client, self.keys)[1:],
                             lambda pipe, copy: pipe.smembers(copy.inflight_pools))
            owners = sorted(set(owners) | {bytes_to_str(p) for (ids,) in found for p in ids})
        for pool_id in owners:
            if pool_id not in beat_of and pool_id != self.own_pool_id:
                result[pool_id] = None
        return result

    def _pool_timings(self, ids: list[str]) -> dict[str, Liveness]:
        """Each registered pool's own dead_after and heartbeat interval, read from its
        hash the first time the pool is seen. A hash without both fields (not written
        yet, or gone) is judged by this pool's settings and read again next pass."""
        unseen = [pool_id for pool_id in ids if pool_id not in self._timings]
        with self.client.pipeline(transaction=False) as pipe:
            for pool_id in unseen:
                pipe.hmget(self.keys.pool(pool_id), LIVENESS_FIELDS)
            infos = pipe.execute() if unseen else []
        timings = {pool_id: self._timings[pool_id] for pool_id in ids
                   if pool_id in self._timings}
        for pool_id, values in zip(unseen, infos, strict=True):
            timings[pool_id] = Liveness.of(dict(zip(LIVENESS_FIELDS, values, strict=True)),
                                           self.settings)
            if all(value is not None for value in values):
                self._timings[pool_id] = timings[pool_id]
        for pool_id in set(self._timings) - set(ids):  # deregistered or reaped
            del self._timings[pool_id]
        return timings

    def stale_pools(self, now: int) -> list[str]:
        """Ids of the pools :meth:`stale` finds."""
        return list(self.stale(now))

    def reap(self, steady_ms: int | None = None) -> ReapResult:
        """One pass: requeue the jobs of every dead pool (under the cluster-wide lock).

        ``steady_ms``: how long the caller has seen Redis answer without a gap; a
        registered pool whose confirm time is longer is left for a later pass (in
        ``waiting``). None judges every pool now (tests, ``reap_now(force=True)``)."""
        result = ReapResult()
        token = uuid.uuid4().hex
        lock_ms = int(max(self.settings.reap_interval, 5.0) * 1000)
        if not self.client.set(self.keys.reaper_lock, token, nx=True, px=lock_ms):
            result.skipped = "another reaper holds the lock"
            return result
        try:
            now = now_ms(self.client)
            # For pools registered without their own dead_after (recover.lua's fallback).
            deadline = now - int(self.settings.dead_after * 1000)
            for pool_id, liveness in self.stale(now).items():
                if liveness is not None and steady_ms is not None \
                        and steady_ms < liveness.confirm_ms:
                    result.waiting.append(pool_id)
                    continue
                self._reap_pool(pool_id, deadline, result)
        finally:
            # Release only our own lock (it may have expired and been taken since).
            self.client.eval(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then "
                "return redis.call('DEL', KEYS[1]) end return 0",
                1, self.keys.reaper_lock, token)
        if result:
            logger.warning(
                "celery_ext: reaped %d dead worker pool(s) %s: %d job(s) requeued, "
                "%d to the dead set", len(result.dead_pools), ", ".join(result.dead_pools),
                len(result.requeued), len(result.dead_jobs))
        return result

    def _reap_pool(self, pool_id: str, deadline: int, result: ReapResult) -> None:
        inflight = self.keys.inflight(pool_id)
        tags = [bytes_to_str(t) for t in self.client.hkeys(inflight)]
        chunks: Iterable[list[str]] = (
            [tags[i:i + RECOVER_CHUNK] for i in range(0, len(tags), RECOVER_CHUNK)] or [[]])
        for chunk in chunks:
            done, requeued, dead = recover_tags(
                self.client, self.settings, pool_id, chunk, mode="pool",
                deadline_ms=deadline, scripts=self.scripts)
            if not done:
                return  # it heartbeated meanwhile: alive after all
            result.requeued += requeued
            result.dead_jobs += dead
        if self.keys.cluster:
            self._reap_copies(pool_id, result)
        result.dead_pools.append(pool_id)
        self._forget_busy(pool_id)

    def _reap_copies(self, pool_id: str, result: ReapResult) -> None:
        """On a cluster, after the pool was declared dead on the home copy: recover its
        records in every job queue's copy ("pool" mode with a future deadline, so its
        join counts as stale: its jobs go back to the front of their queues and its next
        fetch of the queue is refused), the calls pipelined by master; then the home
        ready hint gets the queues that received jobs."""
        parts = copies(self.client, self.keys)[1:]
        seen = per_copy(self.client, parts, lambda pipe, copy: (
            pipe.hkeys(copy.inflight(pool_id)), pipe.zscore(copy.pools, pool_id),
            pipe.sismember(copy.inflight_pools, pool_id)))
        todo = [(copy, [bytes_to_str(t) for t in tags]) for copy, (tags, joined, owner)
                in zip(parts, seen, strict=True) if tags or joined is not None or owner]
        with self.client.pipeline(transaction=False) as pipe:
            for copy, tags in todo:
                pipe.hmget(copy.inflight(pool_id), tags or ["-"])
            records = pipe.execute() if todo else []
        calls, owners = [], []
        steps = self.settings.priority_steps
        for (copy, tags), recs in zip(todo, records, strict=True):
            pairs = pairs_of(copy, steps, tags, recs) if tags else []
            locks = locks_of(copy, recs) if tags else []
            chunks = [pairs[i:i + RECOVER_CHUNK] for i in range(0, len(pairs),
                                                                 RECOVER_CHUNK)] or [[]]
            for chunk in chunks:
                calls.append(recover_call(copy, self.settings, pool_id, chunk, mode="pool",
                                          deadline_ms=JOINED_DEADLINE_MS, locks=locks))
                owners.append(copy)
        ready: set[str] = set()
        for copy, reply in zip(owners, run_scripts(self.client, self.scripts, calls),
                               strict=True):
            _done, requeued, dead = recover_reply(self.client, copy, "pool", reply)
            result.requeued += requeued
            result.dead_jobs += dead
            if requeued:
                ready.add(queue_of(copy))
        if ready:
            self.client.sadd(self.keys.home.ready, *sorted(ready))

    def _forget_busy(self, pool_id: str) -> None:
        """Drop a dead pool's busy-worker records (observational data only), and count
        the pool as reaped in the same MULTI."""
        busy = self.keys.busy(pool_id)
        job_ids = []
        for raw in self.client.hvals(busy):
            try:
                job_ids.append(json.loads(bytes_to_str(raw).split("\n", 1)[1])["job_id"])
            except (ValueError, KeyError, IndexError):
                continue
        with self.client.pipeline() as pipe:
            if job_ids:
                pipe.hdel(self.keys.checkins, *job_ids)
            pipe.delete(busy)
            pipe.hincrby(self.keys.stats, STAT_POOLS_REAPED, 1)
            pipe.execute()

    def reap_now(self, force: bool = False, max_watch: float | None = None) -> ReapResult:
        """The manual pass (``celery ext reap``): first watch Redis answer steadily for
        the confirm time of every pool that looks dead (two of its heartbeat intervals
        and a second), then reap those still stale. Right after a Redis outage or stall
        longer than ``dead_after`` every heartbeat looks old; a live pool stamps again
        while this watches, so it is not reaped.

        ``force=True`` skips the watch: every pool whose heartbeat is old *now* is
        declared dead and its jobs requeued, even if the cause was Redis itself (the
        jobs it runs then run twice). ``max_watch`` caps the watch (seconds; default
        three confirm times); if Redis was not steady that long, nothing registered is
        reaped and ``skipped`` says why."""
        if force:
            return self.reap()
        needed = max((liveness.confirm_ms for liveness in self.stale(now_ms(self.client)).values()
                      if liveness is not None), default=0)
        steady = self.watch(needed, max_watch if max_watch is not None else 3 * needed / 1000)
        result = self.reap(steady_ms=steady)
        result.watched = steady / 1000
        if result.waiting and not result.skipped:
            result.skipped = (f"Redis did not answer steadily for {needed / 1000:.1f}s, so "
                              f"{len(result.waiting)} pool(s) with old heartbeats cannot be told "
                              "from a Redis stall; run again, or --force")
        return result

    def watch(self, needed_ms: int, limit: float) -> int:
        """Read Redis' clock every ``WATCH_POLL`` until it has answered without a gap
        for ``needed_ms`` (or ``limit`` seconds passed); returns the ms of steady
        contact seen last. An error or a late reply starts the count over."""
        if needed_ms <= 0:
            return 0
        give_up = time.monotonic() + limit
        since = last = now_ms(self.client)
        while last - since < needed_ms and time.monotonic() < give_up:
            time.sleep(WATCH_POLL)
            try:
                now = now_ms(self.client)
            except redis.RedisError:
                since = last = -1
                continue
            if last < 0 or now - last > WATCH_GAP_MS + WATCH_POLL * 1000:
                since = now  # a stall (or an error) while watching: start over
            last = now
        return max(0, last - since)

    # -- loop ----------------------------------------------------------------------------
    def steady(self) -> bool:
        """Has this reaper seen Redis answer without a gap for at least dead_after?"""
        if self._steady_since is None or self._last_ok is None:
            return False
        return self._last_ok - self._steady_since >= self.settings.dead_after * 1000

    def tick(self) -> ReapResult | None:
        """One loop step: note Redis' answer for the stall guard, reap if steady, then
        trim the job index (:meth:`trim_index`; after the reap, which matters more)."""
        try:
            now = now_ms(self.client)
        except redis.RedisError:
            self._steady_since = None
            raise
        gap_limit = 2 * self.settings.reap_interval * 1000 + 1000
        if self._last_ok is None or now - self._last_ok > gap_limit:
            self._steady_since = now  # first contact, or after a stall: start over
        self._last_ok = now
        result = None
        if self.steady():
            self.passes += 1
            result = self.reap(steady_ms=now - (self._steady_since or now))
        try:
            self.trim_index()
        except redis.RedisError as exc:
            logger.warning("celery_ext: job index trim skipped: %s", exc)
        return result

    def trim_index(self) -> int:
        """Expire the job index's finished entries past their TTL, a bounded step per
        copy (:func:`~celery_ext.store.job_index.trim_finished`): finishes trim only
        while jobs finish, so each tick does it whatever runs. It judges no pool, so it
        does not wait for the stall guard."""
        return trim_finished(self.client, self.scripts, self.keys, self.settings)

    def _run(self) -> None:
        interval = self.settings.reap_interval
        # Short first wait so a fresh pool checks soon; jitter spreads pools apart.
        wait = min(interval, self.settings.heartbeat_interval) * random.uniform(0.5, 1.0)
        failing = False  # an outage is logged when it starts and when it ends, once
        while not self._stop.wait(wait):
            try:
                self.tick()
                if failing:
                    logger.info("celery_ext: reaper reached Redis again")
                    failing = False
            except redis.RedisError as exc:
                if not failing:
                    logger.warning("celery_ext: reaper passes skipped until Redis answers "
                                   "(unreachable or refusing writes): %s", exc)
                    failing = True
            except Exception:
                logger.exception("celery_ext: reaper pass failed")
            wait = interval * random.uniform(0.8, 1.2)

    def stop(self) -> None:
        self.stop_loop()
