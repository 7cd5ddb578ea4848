"""A pool's in-flight record (``{ns}:inflight:<pool id>``) and the moves out of it.

The record holds every job the pool fetched and has not finished: fetch puts a job
in, atomically with popping it from its queue. It leaves by one of these moves,
each one script: ack (done), requeue (back to the front of its queue), dead (to the
dead set, ``dead.dead_letter``) or recover (counted, by the reaper or when a prefork
child died, ``reaper.recover_tags``).
"""

from __future__ import annotations

from typing import Any

from kombu.utils.encoding import bytes_to_str

from .keys import Keys
from .scripts import Scripts


class InflightRecord:
    """One pool's in-flight record, through one client."""

    def __init__(self, client: Any, keys: Keys, pool_id: str) -> None:
        self.client = client
        self.keys = keys
        self.pool_id = pool_id
        self.key = keys.inflight(pool_id)
        self.scripts = Scripts(client)

    def ack_call(self, tags: list[str]) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the ``ack`` script for ``tags`` (tags last)."""
        k = self.keys
        return ([self.key, k.redelivery, k.running, k.limits, k.ready],
                [k.wake_channel, *tags])

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
        pairs = []
        for tag, rec in zip(tags, self.client.hmget(self.key, tags), strict=True):
            if rec:
                pairs.append((tag, bytes_to_str(rec.split(b"\n", 1)[0])))
        pairs.reverse()  # pushed last = fetched first: the first delivered goes back in front
        done = self.scripts(
            "requeue",
            [self.key, keys.ready, keys.redelivery, keys.running,
             *(keys.queue(q) for _, q in pairs)],
            [keys.wake_channel, keys.queue(""), *(t for t, _ in pairs)],
        )
        return [bytes_to_str(t) for t in done]
