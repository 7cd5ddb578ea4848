"""A pool's in-flight record (``{ns}:inflight:<pool id>``) and the moves out of it.

The record holds every job the pool fetched and has not finished: fetch puts a job
in, atomically with popping it from its queue. It leaves by one of these moves,
each one script: ack (done), requeue (back to the front of its queue's list of its
priority level), dead (to the dead set, ``dead.dead_letter``) or recover (counted: by
the reaper for a dead pool, or when a prefork child died, ``recover_tags``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from .config import DEFAULT_PRIORITY_STEPS, Settings
from .job_index import index_keys, index_ttl_ms
from .keys import STAT_POISON_PILLS, STAT_RECOVERED, Keys
from .priority import level, payload_priority
from .scripts import Scripts

logger = logging.getLogger("celery_ext.inflight")


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


class InflightRecord:
    """One pool's in-flight record, through one client."""

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

    def ack_call(self, tags: list[str]) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the ``ack`` script for ``tags`` (tags last)."""
        k = self.keys
        return ([self.key, k.redelivery, k.running, k.limits, k.ready, *index_keys(k)],
                [k.wake_channel, self.index_ttl, *tags])

    def ack(self, tags: list[str]) -> int:
        """Drop finished jobs from the record; tags no longer in it are ignored."""
        keys, args = self.ack_call(tags)
        return int(self.scripts("ack", keys, args))

    def tags(self) -> list[str]:
        return [bytes_to_str(t) for t in self.client.hkeys(self.key)]

    def requeue(self, tags: list[str]) -> list[str]:
        """Move ``tags`` (in delivery order) to the front of their job queues, the
        first delivered first fetched again. Reads the queues first (a script may only
        touch the keys it is given), then moves atomically; tags no longer in the
        record are skipped. Returns the tags moved."""
        if not tags:
            return []
        keys = self.keys
        pairs = lists_of(self.client, keys, self.priority_steps, self.key, tags)
        done = self.scripts(
            "requeue",
            [self.key, keys.ready, keys.redelivery, keys.running, *index_keys(keys),
             *(q for _, q in pairs)],
            [keys.wake_channel, keys.queue(""), self.index_ttl, *(t for t, _ in pairs)],
        )
        return [bytes_to_str(t) for t in done]


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
                 *, mode: str, deadline_ms: int = 0, reason: str = "worker lost"
                 ) -> tuple[str, list[str], list[Any]]:
    """Name, KEYS and ARGV of one ``recover`` call on the copy ``keys`` for ``pairs``
    (:func:`pairs_of`)."""
    return ("recover",
            [keys.inflight(pool_id), keys.pools, keys.pool(pool_id), keys.inflight_pools,
             keys.ready, keys.redelivery, keys.running, keys.dead, keys.dead_jobs,
             *index_keys(keys), *(q for _, q in pairs)],
            [pool_id, mode, deadline_ms, keys.wake_channel, keys.queue(""),
             settings.max_recoveries, settings.dead_max_size, reason, index_ttl_ms(settings),
             *(t for t, _ in pairs)])


def recover_reply(client: Any, keys: Keys, mode: str, reply: Any
                  ) -> tuple[bool, list[str], list[str]]:
    """(done, requeued tags, dead tags) of a ``recover`` reply, counted in ``keys``'
    stats."""
    status, requeued, dead = reply
    _count_recoveries(client, keys, len(requeued) if mode == "pool" else 0, len(dead))
    return bool(status), [bytes_to_str(t) for t in requeued], [bytes_to_str(t) for t in dead]


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
    pairs = lists_of(client, keys, settings.priority_steps, keys.inflight(pool_id), tags)
    scripts = scripts or Scripts(client)
    reply = scripts(*recover_call(keys, settings, pool_id, pairs, mode=mode,
                                  deadline_ms=deadline_ms, reason=reason))
    return recover_reply(client, keys, mode, reply)
