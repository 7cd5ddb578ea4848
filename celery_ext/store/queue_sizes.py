"""How full the job queues are: size, age of the oldest job and jobs in flight (no KEYS,
no SCAN).

The known queue names come from the ``queues`` set (on a cluster, the registry and the
weighted queues: :func:`celery_ext.store.copies.known_queues`). Sizes and ages come from
the ``queue_info`` script (one call per ``QUEUE_INFO_CHUNK`` names), which returns each
queue's size and the ``enqueued_at`` number of its oldest job, found in that job's last
kilobyte: a 1 MiB job at the head of a queue costs a reader a few bytes, not a megabyte.
The same script forgets names whose list is gone and that nothing configures (see
``queue_info.lua``), so the ``queues`` set holds the job queues that exist or are
paused, limited, weighted or in flight, not every name ever used.

Both sides read this: the leading requeuer samples it into the history, and the admin
side's read model of the queues (the overview) adds weights, limits and counters to it.
"""

from __future__ import annotations

from typing import Any, TypedDict

from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings
from celery_ext.store.clock import now_ms
from celery_ext.store.copies import forget_queues, known_queues, run_scripts
from celery_ext.store.keys import QUEUE_RUNTIME_PREFIXES, QUEUE_STAT_PREFIXES, Keys
from celery_ext.store.liveness import EVERY, Consumed, consumed_by
from celery_ext.store.scripts import Scripts

#: Queue names per ``queue_info`` call: bounds how long one call holds Redis.
QUEUE_INFO_CHUNK = 500


class QueueSize(TypedDict):
    name: str
    size: int
    latency: float | None  # seconds since the oldest queued job was enqueued
    in_flight: int


#: (name, size, oldest job's enqueued_at) of one job queue.
SizeRow = tuple[str, int, float | None]


def _stamp(value: Any) -> float | None:
    """An ``enqueued_at`` number as ``queue_info`` returns it (empty when unknown)."""
    try:
        return float(value) if value else None
    except ValueError:
        return None


def queue_info_rows(reply: list[Any]) -> list[tuple[int, float | None]]:
    """(size, oldest job's enqueued_at) per name of a ``queue_info`` reply."""
    return [(int(reply[j]), _stamp(reply[j + 1])) for j in range(1, len(reply), 2)]


def latency(now: float, size: int, stamp: float | None) -> float | None:
    """Seconds the oldest job of a queue has waited (0 for an empty queue; None when
    its oldest job carries no ``enqueued_at``)."""
    if stamp is not None:
        return max(0.0, now - stamp)
    return 0.0 if not size else None


def count(value: Any) -> int:
    """A counter as Redis returns it (None when absent): 0 unless a whole number."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class QueueSizes:
    """Reads the sizes of one namespace's job queues."""

    def __init__(self, client: Any, settings: Settings | None = None,
                 scripts: Scripts | None = None) -> None:
        self.client: Any = client  # sync client (redis-py types replies as unions)
        self.settings = settings or Settings()
        self.keys = Keys.for_settings(self.settings)
        self.scripts = scripts or Scripts(client)

    def consumers(self) -> Consumed:
        """The job queues the live worker pools consume, from their registrations (three
        round trips): a name one of them consumes is not forgotten."""
        k = self.keys.home
        now = now_ms(self.client)  # (TIME is not pipelined on a cluster)
        beats = self.client.zrange(k.pools, 0, -1, withscores=True)
        with self.client.pipeline(transaction=False) as pipe:
            for pool_id, _ in beats:
                pipe.hgetall(k.pool(bytes_to_str(pool_id)))
            infos = pipe.execute() if beats else []
        return consumed_by(zip(infos, (beat for _, beat in beats), strict=True), now,
                           self.settings)

    def call(self, names: list[str], stamps: bool, consumed: Consumed = EVERY,
             keys: Keys | None = None) -> tuple[list[str], list[str]]:
        """KEYS and ARGV of one ``queue_info`` call (at most ``QUEUE_INFO_CHUNK`` names)
        in ``keys`` (default: the namespace's copy). A name in ``consumed`` is not
        forgotten; with the default, none is for want of a consumer."""
        k = keys or self.keys
        steps = self.settings.priority_steps
        return ([k.queues, k.ready, k.paused, k.limits, k.weights, k.running, k.stats,
                 k.runtime, *(key for n in names for key in k.queue_levels(n, steps))],
                ["1" if stamps else "0", " ".join(QUEUE_STAT_PREFIXES),
                 " ".join(QUEUE_RUNTIME_PREFIXES),
                 "".join("1" if n in consumed else "0" for n in names), *names])

    def read(self, names: list[str], stamps: bool, consumed: Consumed = EVERY
             ) -> tuple[float, list[tuple[int, float | None]]]:
        """Redis time (s) and (size, oldest job's enqueued_at) of each name, on one node;
        size -1 for a name forgotten now (see ``queue_info.lua``)."""
        time_ms, rows = None, []
        for i in range(0, len(names), QUEUE_INFO_CHUNK):
            reply = self.scripts("queue_info", *self.call(names[i:i + QUEUE_INFO_CHUNK], stamps,
                                                          consumed))
            time_ms = int(reply[0])
            rows += queue_info_rows(reply)
        if time_ms is None:
            time_ms = now_ms(self.client)
        return time_ms / 1000, rows

    def read_copies(self, names: list[str], consumed: Consumed = EVERY
                    ) -> tuple[float, list[tuple[int, float | None]]]:
        """Redis time (s) and (size, oldest job's enqueued_at) of each name, each read
        by ``queue_info`` in its own copy (a cluster: the script is cross-slot over
        several queues); size -1 for a name forgotten now, in its copy and then in the
        home copy (:func:`~celery_ext.store.copies.forget_queues`)."""
        # A copy has no weights of its own (they are the home's): a weighted queue is
        # kept as a consumed one is.
        weighted = {bytes_to_str(w) for w in self.client.hkeys(self.keys.home.weights)}
        keep = Consumed(consumed.names | weighted, consumed.every)
        calls = [("queue_info", *self.call([name], True, keep, self.keys.of(name)))
                 for name in names]
        replies = run_scripts(self.client, self.scripts, calls)
        now = (int(replies[0][0]) if replies else now_ms(self.client)) / 1000
        rows = [row for reply in replies for row in queue_info_rows(reply)]
        gone = forget_queues(self.client, self.keys,
                             [n for n, (size, _) in zip(names, rows, strict=True) if size < 0])
        return now, [(-1 if name in gone else max(0, size), stamp)
                     for name, (size, stamp) in zip(names, rows, strict=True)]

    def names(self, consumed: Consumed | None = None) -> list[str]:
        """Names of the job queues, sorted; gone ones are forgotten on the way (on one
        node; a cluster's registry is trimmed by :meth:`read_copies`). ``consumed``:
        as :meth:`consumers` returns it (read when not given)."""
        if self.keys.cluster:
            return known_queues(self.client, self.keys)
        names = sorted(bytes_to_str(n) for n in self.client.smembers(self.keys.queues))
        _, rows = self.read(names, False, self.consumers() if consumed is None else consumed)
        return [name for name, (size, _) in zip(names, rows, strict=True) if size >= 0]

    def sizes(self, offset: int = 0, limit: int | None = None, prefix: str | None = None,
              consumed: Consumed | None = None) -> tuple[float, list[SizeRow]]:
        """Redis time (s) and one page of job queues by name (those starting with
        ``prefix``), each with its size and oldest job's enqueued_at; the gone ones are
        forgotten on the way. ``consumed``: as :meth:`consumers` returns it (read when
        not given)."""
        k = self.keys
        if consumed is None:
            consumed = self.consumers()
        if k.cluster:
            names = known_queues(self.client, k)
        elif offset or limit is not None:  # forget gone names first, or pages would shift
            names = self.names(consumed)
        else:  # every name: the one queue_info pass below forgets the gone ones
            names = sorted(bytes_to_str(n) for n in self.client.smembers(k.queues))
        names = [n for n in names if not prefix or n.startswith(prefix)]
        names = names[offset:offset + limit if limit is not None else None]
        if not names:
            return 0.0, []
        if k.cluster:
            now, info = self.read_copies(names, consumed)
        else:
            now, info = self.read(names, True, consumed)
        return now, [(name, size, stamp) for name, (size, stamp) in zip(names, info, strict=True)
                     if size >= 0]

    def in_flight(self, names: list[str]) -> list[int]:
        """Jobs of each queue in flight in all pools (the ``running`` counters; on a
        cluster each read in its queue's copy, one pipeline)."""
        if not names:
            return []
        if not self.keys.cluster:
            return [max(0, count(n)) for n in self.client.hmget(self.keys.running, names)]
        with self.client.pipeline(transaction=False) as pipe:  # by master on a cluster
            for name in names:
                pipe.hget(self.keys.of(name).running, name)
            return [max(0, count(n)) for n in pipe.execute()]

    def job_queues(self, offset: int = 0, limit: int | None = None,
                   prefix: str | None = None) -> list[QueueSize]:
        """One page of job queues with size, latency and jobs in flight."""
        now, rows = self.sizes(offset, limit, prefix)
        running = self.in_flight([name for name, _, _ in rows])
        return [QueueSize(name=name, size=size, latency=latency(now, size, stamp),
                          in_flight=n)
                for (name, size, stamp), n in zip(rows, running, strict=True)]
