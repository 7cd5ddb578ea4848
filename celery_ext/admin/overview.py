"""Read model of job queues, worker pools and busy workers (no KEYS, no SCAN).

Everything here is read with a few pipelined round trips, whatever the number of
queues: the known queue names come from the ``queues`` set, pools from the ``pools``
zset. ``celery_ext.client`` is the facade the dashboard and the CLI use; this
module is its pools/queues half. Queue sizes and ages come from
:mod:`celery_ext.store.queue_sizes`, which the worker side reads too; this module adds
what only a person looks at (weights, limits, counters, fair keys, pools, busy workers).
"""

from __future__ import annotations

import json
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from celery_ext.admin.api_types import BusyWorker, PoolInfo, QueueInfo
from celery_ext.config import Settings
from celery_ext.options.fair import fair_info
from celery_ext.options.rate_limits import format_rate
from celery_ext.store.clock import now_ms
from celery_ext.store.copies import copies, per_copy
from celery_ext.store.keys import Keys
from celery_ext.store.liveness import Consumed, Liveness, queues_of
from celery_ext.store.queue_sizes import (
    QUEUE_INFO_CHUNK,
    QueueSizes,
    latency,
    queue_info_rows,
)
from celery_ext.store.scripts import Scripts
from celery_ext.store.stop_requests import request_stop, requested

__all__ = ["QUEUE_INFO_CHUNK", "BusyWorker", "PoolInfo", "QueueInfo", "State",
           "queue_info_rows"]


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _not_due_for(tat: Any, now: float) -> float | None:
    """Seconds until a queue's next job may be fetched (``rate_tat``, µs on the Redis
    clock: a rate limit's next slot or a throttle's hold), None when it may be now."""
    wait = _int(tat) / 1e6 - now if tat is not None else 0.0
    return round(wait, 3) if wait > 0 else None


class State:
    """Reads the plugin's records for one namespace."""

    def __init__(self, client: redis.Redis, settings: Settings | None = None) -> None:
        self.client: Any = client  # sync client (redis-py types replies as unions)
        self.settings = settings or Settings()
        self.keys = Keys.for_settings(self.settings)
        self.scripts = Scripts(client)
        self.sizes = QueueSizes(client, self.settings, self.scripts)

    # -- queues ------------------------------------------------------------------------
    def queue_info_call(self, names: list[str], stamps: bool) -> tuple[list[str], list[str]]:
        """KEYS and ARGV of one ``queue_info`` call (at most ``QUEUE_INFO_CHUNK`` names)."""
        return self.sizes.call(names, stamps)

    def queue_names(self) -> list[str]:
        """Names of the job queues, sorted (see :meth:`QueueSizes.names`)."""
        return self.sizes.names()

    def job_queues(self, offset: int = 0, limit: int | None = None,
                   prefix: str | None = None) -> list[QueueInfo]:
        """One page of job queues with size, latency, weight and counters."""
        consumed = self.consumed_queues()
        now, rows = self.sizes.sizes(offset, limit, prefix, consumed)
        if not rows:
            return []
        names = [name for name, _, _ in rows]
        reads = self._copies_reads(names) if self.keys.cluster else self._reads(names)
        fair = fair_info(self.client, self.keys, names)
        result: list[QueueInfo] = []
        for (name, size, stamp), (weight, paused, limit_, running, processed, failed,
                                  rate, tat) in zip(rows, reads, strict=True):
            result.append(QueueInfo(
                name=name,
                size=size,
                latency=latency(now, size, stamp),
                weight=_int(weight, self.settings.default_weight),
                paused=paused,
                max_concurrency=_int(limit_) if limit_ is not None else None,
                rate_limit=format_rate(_int(rate)) if _int(rate) > 0 else None,
                not_due_for=_not_due_for(tat, now),
                in_flight=max(0, _int(running)),
                processed=_int(processed),
                failed=_int(failed),
                fair=fair.get(name),
                consumed=name in consumed,
            ))
        return result

    def consumed_queues(self) -> Consumed:
        """The job queues some live worker pool consumes (see :func:`consumed_by`)."""
        return self.sizes.consumers()

    def _reads(self, names: list[str]
               ) -> list[tuple[Any, bool, Any, Any, Any, Any, Any, Any]]:
        """Per queue (one node, one pipeline): weight, paused, concurrency limit, jobs
        in flight, processed, failed, rate limit, and when its next job may be fetched
        (a rate limit's or a throttle's, ``rate_tat``), as stored."""
        k = self.keys
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(k.weights, names)
            pipe.smembers(k.paused)
            pipe.hmget(k.limits, names)
            pipe.hmget(k.running, names)
            pipe.hmget(k.stats, [f"processed:{n}" for n in names])
            pipe.hmget(k.stats, [f"failed:{n}" for n in names])
            pipe.hmget(k.rate_limits, names)
            pipe.hmget(k.rate_tat, names)
            weights, paused, limits, running, processed, failed, rates, tats = pipe.execute()
        paused_names = {bytes_to_str(p) for p in paused}
        return [(weights[i], name in paused_names, limits[i], running[i], processed[i],
                 failed[i], rates[i], tats[i]) for i, name in enumerate(names)]

    def _copies_reads(self, names: list[str]
                      ) -> list[tuple[Any, bool, Any, Any, Any, Any, Any, Any]]:
        """:meth:`_reads` on a cluster: each queue's values read in its own copy (one
        pipeline, grouped by master); weights from the home copy."""
        k = self.keys
        weights = self.client.hmget(k.home.weights, names)
        with self.client.pipeline(transaction=False) as pipe:  # by master on a cluster
            for name in names:
                c = k.of(name)
                pipe.sismember(c.paused, name).hget(c.limits, name).hget(c.running, name)
                pipe.hget(c.stats, f"processed:{name}").hget(c.stats, f"failed:{name}")
                pipe.hget(c.rate_limits, name).hget(c.rate_tat, name)
            flat = pipe.execute()
        return [(weights[i], bool(flat[7 * i]), *flat[7 * i + 1:7 * i + 7])
                for i in range(len(names))]

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
                queues=queues_of(info) or [],
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
                pipe.zscore(k.stop_requests, job_id)
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
                stop_requested=requested(stop, now),
            ))
        return sorted(result, key=lambda b: b["started_at"])

    def request_stop(self, job_id: str) -> bool:
        """Ask a running job to stop: its next checkin returns True. False when the job
        is not in flight (nothing is recorded; see :mod:`celery_ext.store.stop_requests`)."""
        return request_stop(self.client, self.settings, job_id)
