"""Read model of job queues, worker pools and busy workers (no KEYS, no SCAN).

Everything here is read with a few pipelined round trips, whatever the number of
queues: the known queue names come from the ``queues`` set, pools from the ``pools``
zset. ``celery_ext.client`` is the facade the dashboard and the CLI use; this
module is its pools/queues half.

Queue sizes and latencies come from the ``queue_info`` script (one call per 500
names), which returns each queue's size and the ``enqueued_at`` number of its oldest
job, found in that job's last kilobyte: a 1 MiB job at the head of a queue costs a
reader a few bytes, not a megabyte. The same script forgets names whose list is gone
and that nothing configures (see ``queue_info.lua``), so the ``queues`` set holds
the job queues that exist or are paused, limited, weighted or in flight, not every
name ever used.
"""

from __future__ import annotations

import json
from typing import Any, TypedDict

import redis
from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings
from celery_ext.options.fair import FairInfo, fair_info
from celery_ext.options.rate_limits import format_rate
from celery_ext.store.clock import now_ms
from celery_ext.store.copies import copies, known_queues, per_copy, run_scripts
from celery_ext.store.keys import Keys
from celery_ext.store.liveness import Liveness
from celery_ext.store.scripts import Scripts

#: Queue names per ``queue_info`` call: bounds how long one call holds Redis.
QUEUE_INFO_CHUNK = 500


class QueueInfo(TypedDict):
    name: str
    size: int
    latency: float | None  # seconds since the oldest queued job was enqueued
    weight: int
    paused: bool
    max_concurrency: int | None
    rate_limit: str | None  # cluster-wide, e.g. "20/s" (rate_limits.py)
    in_flight: int
    processed: int
    failed: int
    #: A queue with keyed jobs waiting: its active fair keys (count, biggest); else None.
    fair: FairInfo | None


class PoolInfo(TypedDict):
    pool_id: str
    node: str
    host: str
    pid: int | None
    concurrency: str
    pool_type: str
    queues: list[str]
    started_at: float | None
    heartbeat_age: float | None  # seconds, by Redis time
    state: str  # running, stopping, dead (heartbeat older than its dead_after), orphaned
    in_flight: int


class BusyWorker(TypedDict):
    pool_id: str
    slot: str
    job_id: str
    job_name: str
    args: str
    started_at: float
    checkin_at: float | None
    checkin_message: str | None
    progress: float | None
    stall_after: float | None
    stalled: bool
    stop_requested: bool


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _stamp(value: Any) -> float | None:
    """An ``enqueued_at`` number as ``queue_info`` returns it (empty when unknown)."""
    try:
        return float(value) if value else None
    except ValueError:
        return None


def queue_info_rows(reply: list[Any]) -> list[tuple[int, float | None]]:
    """(size, oldest job's enqueued_at) per name of a ``queue_info`` reply."""
    return [(int(reply[j]), _stamp(reply[j + 1])) for j in range(1, len(reply), 2)]


class State:
    """Reads the plugin's records for one namespace."""

    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        self.client: Any = client  # sync client (redis-py types replies as unions)
        self.settings = settings or Settings()
        self.keys = Keys.for_settings(self.settings)
        self.scripts = Scripts(client)

    # -- queues ------------------------------------------------------------------------
    def _queue_info(self, names: list[str], stamps: bool
                    ) -> tuple[float, list[tuple[int, float | None]]]:
        """Redis time (s) and (size, oldest job's enqueued_at) of each name; size -1 for
        a name forgotten now (see ``queue_info.lua``)."""
        time_ms, rows = None, []
        for i in range(0, len(names), QUEUE_INFO_CHUNK):
            reply = self.scripts("queue_info",
                                 *self.queue_info_call(names[i:i + QUEUE_INFO_CHUNK], stamps))
            time_ms = int(reply[0])
            rows += queue_info_rows(reply)
        if time_ms is None:
            time_ms = now_ms(self.client)
        return time_ms / 1000, rows

    def queue_info_call(self, names: list[str], stamps: bool) -> tuple[list[str], list[str]]:
        """KEYS and ARGV of one ``queue_info`` call (at most ``QUEUE_INFO_CHUNK`` names)."""
        k = self.keys
        steps = self.settings.priority_steps
        return ([k.queues, k.ready, k.paused, k.limits, k.weights, k.running,
                 *(key for n in names for key in k.queue_levels(n, steps))],
                ["1" if stamps else "0", *names])

    def queue_names(self) -> list[str]:
        """Names of the job queues, sorted; gone ones are forgotten on the way (on one
        node; a cluster's registry is not trimmed by readers, see queue_info.lua)."""
        if self.keys.cluster:
            return known_queues(self.client, self.keys)
        names = sorted(bytes_to_str(n) for n in self.client.smembers(self.keys.queues))
        _, rows = self._queue_info(names, stamps=False)
        return [name for name, (size, _) in zip(names, rows, strict=True) if size >= 0]

    def job_queues(self, offset: int = 0, limit: int | None = None,
                   prefix: str | None = None) -> list[QueueInfo]:
        """One page of job queues with size, latency, weight and counters."""
        k = self.keys
        if k.cluster:
            return self._job_queues_copies(offset, limit, prefix)
        if offset or limit is not None:  # forget gone names first, or pages would shift
            names = self.queue_names()
        else:  # every name: the one queue_info pass below forgets the gone ones
            names = sorted(bytes_to_str(n) for n in self.client.smembers(k.queues))
        names = [n for n in names if not prefix or n.startswith(prefix)]
        names = names[offset:offset + limit if limit is not None else None]
        now, info = self._queue_info(names, stamps=True)
        rows = [(name, size, stamp) for name, (size, stamp) in zip(names, info, strict=True)
                if size >= 0]
        if not rows:
            return []
        names = [name for name, _, _ in rows]
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(k.weights, names)
            pipe.smembers(k.paused)
            pipe.hmget(k.limits, names)
            pipe.hmget(k.running, names)
            pipe.hmget(k.stats, [f"processed:{n}" for n in names])
            pipe.hmget(k.stats, [f"failed:{n}" for n in names])
            pipe.hmget(k.rate_limits, names)
            weights, paused, limits, running, processed, failed, rates = pipe.execute()
        paused_names = {bytes_to_str(p) for p in paused}
        fair = fair_info(self.client, k, names)
        result: list[QueueInfo] = []
        for i, (name, size, stamp) in enumerate(rows):
            result.append(QueueInfo(
                name=name,
                size=size,
                latency=max(0.0, now - stamp) if stamp is not None else (0.0 if not size else None),
                weight=_int(weights[i], self.settings.default_weight),
                paused=name in paused_names,
                max_concurrency=_int(limits[i]) if limits[i] is not None else None,
                rate_limit=format_rate(_int(rates[i])) if _int(rates[i]) > 0 else None,
                in_flight=max(0, _int(running[i])),
                processed=_int(processed[i]),
                failed=_int(failed[i]),
                fair=fair.get(name),
            ))
        return result

    def _job_queues_copies(self, offset: int, limit: int | None,
                           prefix: str | None) -> list[QueueInfo]:
        """:meth:`job_queues` on a cluster: the known queues, each read in its own copy
        (``queue_info`` per copy and one pipeline of per-copy reads, grouped by master);
        weights from the home copy. Nothing is forgotten (the registry is a hint)."""
        names = [n for n in known_queues(self.client, self.keys)
                 if not prefix or n.startswith(prefix)]
        names = names[offset:offset + limit if limit is not None else None]
        if not names:
            return []
        now, info = self.queue_rows(names)
        k = self.keys
        weights = self.client.hmget(k.home.weights, names)
        with self.client.pipeline(transaction=False) as pipe:  # by master on a cluster
            for name in names:
                c = k.of(name)
                pipe.sismember(c.paused, name).hget(c.limits, name).hget(c.running, name)
                pipe.hget(c.stats, f"processed:{name}").hget(c.stats, f"failed:{name}")
                pipe.hget(c.rate_limits, name)
            flat = pipe.execute()
        reads = [flat[j:j + 6] for j in range(0, len(flat), 6)]
        fair = fair_info(self.client, k, names)
        result: list[QueueInfo] = []
        for i, (name, (size, stamp)) in enumerate(zip(names, info, strict=True)):
            paused, limit_, running, processed, failed, rate = reads[i]
            result.append(QueueInfo(
                name=name,
                size=size,
                latency=max(0.0, now - stamp) if stamp is not None else (0.0 if not size else None),
                weight=_int(weights[i], self.settings.default_weight),
                paused=bool(paused),
                max_concurrency=_int(limit_) if limit_ is not None else None,
                rate_limit=format_rate(_int(rate)) if _int(rate) > 0 else None,
                in_flight=max(0, _int(running)),
                processed=_int(processed),
                failed=_int(failed),
                fair=fair.get(name),
            ))
        return result

    def queue_rows(self, names: list[str]) -> tuple[float, list[tuple[int, float | None]]]:
        """Redis time (s) and (size, oldest job's enqueued_at) of each name, each read
        by ``queue_info`` in its own copy (a cluster: the script is cross-slot over
        several queues). A copy's own registry may lose the name there; the size is 0."""
        calls = []
        for name in names:
            c = self.keys.of(name)
            calls.append(("queue_info",
                          [c.queues, c.ready, c.paused, c.limits, c.weights, c.running,
                           *c.queue_levels(name, self.settings.priority_steps)],
                          ["1", name]))
        replies = run_scripts(self.client, self.scripts, calls)
        now = (int(replies[0][0]) if replies else now_ms(self.client)) / 1000
        return now, [(max(0, size), stamp) for reply in replies
                     for size, stamp in queue_info_rows(reply)]

    def totals(self) -> dict[str, int]:
        """Processed/failed/retried counters over all queues (for throughput plots),
        summed over the copies."""
        fields = ["processed", "failed", "retried"]
        raws = per_copy(self.client, copies(self.client, self.keys),
                        lambda p, c: p.hmget(c.stats, fields))
        return {f: sum(_int(raw[j]) for (raw,) in raws) for j, f in enumerate(fields)}

    # -- pools -------------------------------------------------------------------------
    def worker_pools(self) -> list[PoolInfo]:
        k = self.keys
        beats = self.client.zrange(k.pools, 0, -1, withscores=True)
        parts = copies(self.client, k)
        owners = {bytes_to_str(p) for (found,) in per_copy(
            self.client, parts, lambda p, c: p.smembers(c.inflight_pools)) for p in found}
        ids = [bytes_to_str(p) for p, _ in beats]
        ids += sorted(owners - set(ids))  # orphans: own jobs but are not registered
        now = now_ms(self.client)
        with self.client.pipeline(transaction=False) as pipe:
            for pool_id in ids:
                pipe.hgetall(k.pool(pool_id))
                pipe.hlen(k.inflight(pool_id))
            replies = pipe.execute()
        if len(parts) > 1:  # a cluster: a pool's in-flight jobs of a queue are in its copy
            held = per_copy(self.client, parts[1:], lambda p, c: [
                p.hlen(c.inflight(pool_id)) for pool_id in ids])
            for i in range(len(ids)):
                replies[2 * i + 1] += sum(_int(h[i]) for h in held)
        beat_of = {bytes_to_str(p): s for p, s in beats}
        result: list[PoolInfo] = []
        for i, pool_id in enumerate(ids):
            info = {bytes_to_str(a): bytes_to_str(b) for a, b in replies[2 * i].items()}
            beat = beat_of.get(pool_id)
            age = (now - beat) / 1000 if beat is not None else None
            if age is None:
                state = "orphaned"
            elif Liveness.of(info, self.settings).stale(beat, now):  # the reaper's rule
                state = "dead"
            else:
                state = info.get("state", "running")
            started = info.get("started_at") or info.get("registered_at")
            result.append(PoolInfo(
                pool_id=pool_id,
                node=info.get("node", ""),
                host=info.get("host", pool_id.split(":", 1)[0]),
                pid=_int(info.get("pid"), 0) or None,
                concurrency=info.get("concurrency", ""),
                pool_type=info.get("pool_type", ""),
                queues=[q for q in info.get("queues", "").split(",") if q],
                started_at=_int(started) / 1000 if started else None,
                heartbeat_age=age,
                state=state,
                in_flight=_int(replies[2 * i + 1]),
            ))
        return result

    # -- busy workers ------------------------------------------------------------------
    def busy_workers(self) -> list[BusyWorker]:
        k = self.keys
        ids = [bytes_to_str(p) for p in self.client.zrange(k.pools, 0, -1)]
        now = now_ms(self.client)
        with self.client.pipeline(transaction=False) as pipe:
            for pool_id in ids:
                pipe.hgetall(k.busy(pool_id))
            replies = pipe.execute()
        rows: list[tuple[str, str, int, dict[str, Any]]] = []
        for pool_id, slots in zip(ids, replies, strict=True):
            for slot, raw in slots.items():
                try:
                    started, record = bytes_to_str(raw).split("\n", 1)
                    rows.append((pool_id, bytes_to_str(slot), int(started), json.loads(record)))
                except ValueError:
                    continue
        if not rows:
            return []
        job_ids = [r[3].get("job_id", "") for r in rows]
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(k.checkins, job_ids)
            for job_id in job_ids:
                pipe.sismember(k.stop_requests, job_id)
            checkins, *stops = pipe.execute()
        result: list[BusyWorker] = []
        for (pool_id, slot, started, record), raw, stop in zip(rows, checkins, stops,
                                                                strict=True):
            at: int | None = None
            data: dict[str, Any] = {}
            if raw:
                at_s, body = bytes_to_str(raw).split("\n", 1)
                at, data = int(at_s), json.loads(body)
            stall_after = record.get("stall_after")
            last = at if at is not None else started
            result.append(BusyWorker(
                pool_id=pool_id,
                slot=slot,
                job_id=record.get("job_id", ""),
                job_name=record.get("job_name", ""),
                args=record.get("args", ""),
                started_at=started / 1000,
                checkin_at=at / 1000 if at is not None else None,
                checkin_message=data.get("message"),
                progress=data.get("progress"),
                stall_after=stall_after,
                stalled=stall_after is not None and (now - last) / 1000 > float(stall_after),
                stop_requested=bool(stop),
            ))
        return sorted(result, key=lambda b: b["started_at"])

    def request_stop(self, job_id: str) -> None:
        """Ask a running job to stop: its next checkin returns True."""
        self.client.sadd(self.keys.stop_requests, job_id)
