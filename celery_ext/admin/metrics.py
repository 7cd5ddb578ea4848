"""Prometheus metrics of one namespace: a collector that reads Redis at each scrape.

Served at ``/metrics`` by the dashboard (``celery ext web``) and by the metrics-only
process ``celery ext metrics`` (see ``docs/operations.md``). Nothing is kept in the
serving process: every scrape reads the plugin's records afresh, in two round trips
whatever the number of job queues and pools (the names, then one pipeline with the
``queue_info`` script for sizes and latencies, and small hashes, ZCARDs and HLENs),
never a job itself. Several dashboards may serve the same namespace: the values are
Redis', so they agree.

The counters are written where the event happens: processed/failed/retried, the
runtime histogram and the queue wait-time histogram by the observer (summed per
process, flushed once a second; ``worker/wait_times.py``), jobs recovered and poison
pills after the ``recover`` script, pools reaped by the reaper, unique hits by the
producer, rate-limited fetches (field ``rate_limited``) by the fetch path when rate
limits are in use.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from celery_ext.admin.overview import QUEUE_INFO_CHUNK, State, queue_info_rows
from celery_ext.config import WAIT_BUCKETS
from celery_ext.store.copies import copies, per_copy, set_counts
from celery_ext.store.keys import (
    RUNTIME_BUCKET_NAMES,
    RUNTIME_BUCKETS,
    STAT_POISON_PILLS,
    STAT_POOLS_REAPED,
    STAT_RECOVERED,
    STAT_UNIQUE_HITS,
    WAIT_BUCKET_NAMES,
    WAIT_SUM_PREFIX,
)
from celery_ext.store.liveness import Liveness, consumed_by
from celery_ext.store.scripts import sha

logger = logging.getLogger("celery_ext.admin.metrics")

#: Prefix of every metric name.
PREFIX = "celery_ext"
#: Field of ``{ns}:stats`` counting fetches refused by a cluster-wide rate limit.
STAT_RATE_LIMITED = "rate_limited"
#: Global ``{ns}:stats`` fields exported as counters: field -> (metric name, help).
GLOBAL_COUNTERS = {
    STAT_RECOVERED: ("jobs_recovered", "Jobs the reaper returned to their queue from dead "
                     "worker pools."),
    STAT_POOLS_REAPED: ("pools_reaped", "Worker pools the reaper declared dead."),
    STAT_POISON_PILLS: ("poison_pills", "Jobs moved to the dead set after killing their "
                        "worker more than max_recoveries times."),
    STAT_UNIQUE_HITS: ("unique_hits", "Enqueues of unique jobs dropped because an identical "
                       "job was pending."),
    STAT_RATE_LIMITED: ("rate_limited_fetches", "Fetches refused by a rate limit."),
}
#: Per-queue ``{ns}:stats`` outcome fields exported as counters.
QUEUE_COUNTERS = {
    "processed": "Jobs that finished successfully.",
    "failed": "Jobs that failed (no retry left, or not retried).",
    "retried": "Runs that ended in a retry.",
}


@dataclass
class QueueSample:
    depth: int = 0
    latency: float = 0.0  # seconds since the oldest queued job was enqueued
    in_flight: int = 0
    paused: bool = False
    consumed: bool = True  # a live worker pool consumes it

    @property
    def unconsumed(self) -> bool:
        """Jobs wait and no live pool consumes the queue (a typo in a task name, or a
        deploy not yet rolled out): they wait until a pool that knows the task starts."""
        return self.depth > 0 and not self.consumed


@dataclass
class PoolSample:
    alive: bool
    busy: int
    in_flight: int
    concurrency: int | None
    heartbeat_age: float
    node: str


@dataclass
class Snapshot:
    """What one scrape read."""

    queues: dict[str, QueueSample] = field(default_factory=dict)
    pools: dict[str, PoolSample] = field(default_factory=dict)
    #: ``{ns}:stats`` and ``{ns}:runtime`` as read, field -> int.
    stats: dict[str, int] = field(default_factory=dict)
    runtime: dict[str, int] = field(default_factory=dict)
    scheduled: int = 0
    retry: int = 0
    dead: int = 0


def _ints(raw: dict[Any, Any]) -> dict[str, int]:
    out = {}
    for k, v in raw.items():
        try:
            out[bytes_to_str(k)] = int(v)
        except ValueError:
            continue
    return out


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def read_snapshot(state: State) -> Snapshot:
    """Read every value the metrics show: the names of the job queues and pools, then
    one pipeline for the rest (``queue_info`` by SHA; a server that lost its scripts
    gets them loaded and the pipeline sent once more)."""
    client, k = state.client, state.keys
    if k.cluster:
        return _read_snapshot_copies(state)
    with client.pipeline(transaction=False) as pipe:
        pipe.smembers(k.queues).zrange(k.pools, 0, -1, withscores=True)
        raw_names, beats = pipe.execute()
    names = sorted(bytes_to_str(n) for n in raw_names)
    pool_ids = [bytes_to_str(p) for p, _ in beats]
    chunks = [names[i:i + QUEUE_INFO_CHUNK] for i in range(0, len(names), QUEUE_INFO_CHUNK)]
    for attempt in (1, 2):
        with client.pipeline(transaction=False) as pipe:
            pipe.time()
            for chunk in chunks:
                keys, args = state.queue_info_call(chunk, stamps=True)
                pipe.evalsha(sha("queue_info"), len(keys), *keys, *args)
            pipe.smembers(k.paused).hgetall(k.running).hgetall(k.stats).hgetall(k.runtime)
            pipe.zcard(k.scheduled).zcard(k.retry).zcard(k.dead)
            for pool_id in pool_ids:
                pipe.hgetall(k.pool(pool_id)).hlen(k.busy(pool_id)).hlen(k.inflight(pool_id))
            try:
                replies = pipe.execute()
                break
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                state.scripts.load_all()
    seconds, micros = replies[0]
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    infos, rest = replies[1:1 + len(chunks)], replies[1 + len(chunks):]
    paused, running, stats, runtime, scheduled, retry, dead = rest[:7]
    pool_replies = rest[7:]

    snap = Snapshot(stats=_ints(stats), runtime=_ints(runtime), scheduled=int(scheduled),
                    retry=int(retry), dead=int(dead))
    paused_names = {bytes_to_str(p) for p in paused}
    in_flight = _ints(running)
    pool_infos = [{bytes_to_str(a): bytes_to_str(b) for a, b in raw.items()}
                  for raw in pool_replies[0::3]]
    consumed = consumed_by(zip(pool_infos, (beat for _, beat in beats), strict=True), now_ms,
                           state.settings)
    for chunk, reply in zip(chunks, infos, strict=True):
        for name, (size, stamp) in zip(chunk, queue_info_rows(reply), strict=True):
            if size < 0:  # forgotten just now: gone and unused
                continue
            snap.queues[name] = QueueSample(
                depth=size,
                latency=max(0.0, now_ms / 1000 - stamp) if stamp is not None else 0.0,
                in_flight=max(0, in_flight.get(name, 0)),
                paused=name in paused_names,
                consumed=name in consumed)
    beat_of = {bytes_to_str(p): s for p, s in beats}
    for i, pool_id in enumerate(pool_ids):
        _, busy, held = pool_replies[3 * i:3 * i + 3]
        info = pool_infos[i]
        beat = beat_of[pool_id]
        snap.pools[pool_id] = PoolSample(
            alive=bool(info) and not Liveness.of(info, state.settings).stale(beat, now_ms),
            busy=int(busy), in_flight=int(held),
            concurrency=_int_or_none(info.get("concurrency")),
            heartbeat_age=max(0.0, (now_ms - beat) / 1000), node=info.get("node", ""))
    return snap


def _read_snapshot_copies(state: State) -> Snapshot:
    """:func:`read_snapshot` on a cluster: the queues as :meth:`State.job_queues` reads
    them (each in its copy), the counters summed over the copies, the runtime
    histograms and the pools from the home copy."""
    client, k = state.client, state.keys
    parts = copies(client, k)
    stats: dict[str, int] = {}
    for (raw,) in per_copy(client, parts, lambda p, c: p.hgetall(c.stats)):
        for name, n in _ints(raw).items():
            stats[name] = stats.get(name, 0) + n
    scheduled, retry, dead = set_counts(client, k)
    snap = Snapshot(stats=stats, runtime=_ints(client.hgetall(k.runtime)),
                    scheduled=scheduled, retry=retry, dead=dead)
    for q in state.job_queues():
        snap.queues[q["name"]] = QueueSample(
            depth=q["size"], latency=q["latency"] or 0.0, in_flight=q["in_flight"],
            paused=q["paused"], consumed=q["consumed"])
    for pool in state.worker_pools():
        if pool["heartbeat_age"] is None:
            continue  # an orphan: not registered (the one-node scrape reads registered pools)
        busy = int(client.hlen(k.busy(pool["pool_id"])))
        snap.pools[pool["pool_id"]] = PoolSample(
            alive=pool["state"] != "dead", busy=busy,
            in_flight=pool["in_flight"], concurrency=_int_or_none(pool["concurrency"]),
            heartbeat_age=max(0.0, pool["heartbeat_age"]), node=pool["node"])
    return snap


def _split(fields: dict[str, int]) -> dict[str, dict[str, int]]:
    """``"<tag>:<queue>" -> n`` as ``{tag: {queue: n}}`` (fields without a queue skipped)."""
    out: dict[str, dict[str, int]] = {}
    for name, value in fields.items():
        tag, sep, queue = name.partition(":")
        if sep:
            out.setdefault(tag, {})[queue] = value
    return out


def families(snap: Snapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (names follow Prometheus conventions)."""
    def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)

    def counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
        return CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)

    depth = gauge("queue_depth", "Jobs waiting in the job queue.", ["queue"])
    latency = gauge("queue_latency_seconds", "Age of the oldest waiting job (0 when empty).",
                    ["queue"])
    in_flight = gauge("queue_in_flight_jobs", "Jobs of the queue fetched by worker pools "
                      "and not finished.", ["queue"])
    paused = gauge("queue_paused", "1 if the job queue is paused.", ["queue"])
    unconsumed = gauge("queue_unconsumed", "1 if jobs wait in the job queue and no live "
                       "worker pool consumes it (they wait for a pool that knows the task).",
                       ["queue"])
    for name, q in snap.queues.items():
        depth.add_metric([name], q.depth)
        latency.add_metric([name], q.latency)
        in_flight.add_metric([name], q.in_flight)
        paused.add_metric([name], 1 if q.paused else 0)
        unconsumed.add_metric([name], 1 if q.unconsumed else 0)
    yield from (depth, latency, in_flight, paused, unconsumed)

    per_queue = _split(snap.stats)
    for outcome, doc in QUEUE_COUNTERS.items():
        family = counter(f"jobs_{outcome}", doc, ["queue"])
        for name, value in sorted(per_queue.get(outcome, {}).items()):
            family.add_metric([name], value)
        yield family

    by_bucket = _split(snap.runtime)
    yield _histogram("job_runtime_seconds", "Time a job ran, from start to end in its worker.",
                     by_bucket, RUNTIME_BUCKETS, RUNTIME_BUCKET_NAMES, "sum_us")
    yield _histogram("job_wait_seconds", "Time a job waited in its job queue, from its enqueue "
                     "(its due time, for a countdown or eta) to the start of its run, on the "
                     "Redis clock.", by_bucket, WAIT_BUCKETS, WAIT_BUCKET_NAMES, WAIT_SUM_PREFIX)

    alive = gauge("pool_alive", "1 while the worker pool heartbeats within its dead_after.",
                  ["pool", "node"])
    busy = gauge("pool_busy_slots", "Execution slots running a job for more than 0.1 s.",
                 ["pool"])
    held = gauge("pool_in_flight_jobs", "Jobs the worker pool owns (reserved or running).",
                 ["pool"])
    concurrency = gauge("pool_concurrency", "Execution slots of the worker pool.", ["pool"])
    age = gauge("pool_heartbeat_age_seconds", "Seconds since the pool's last heartbeat "
                "(Redis time).", ["pool"])
    for pool_id, p in sorted(snap.pools.items()):
        alive.add_metric([pool_id, p.node], 1 if p.alive else 0)
        busy.add_metric([pool_id], p.busy)
        held.add_metric([pool_id], p.in_flight)
        if p.concurrency is not None:
            concurrency.add_metric([pool_id], p.concurrency)
        age.add_metric([pool_id], p.heartbeat_age)
    yield from (alive, busy, held, concurrency, age)

    for name, doc, value in (
            ("scheduled_jobs", "Jobs in the scheduled set (countdown/eta, retries included).",
             snap.scheduled),
            ("retry_jobs", "Jobs in the retry set (retries waiting for their backoff).",
             snap.retry),
            ("dead_jobs", "Jobs in the dead set.", snap.dead)):
        size = gauge(name, doc)
        size.add_metric([], value)
        yield size
    for stat, (name, doc) in GLOBAL_COUNTERS.items():
        family = counter(name, doc)
        family.add_metric([], snap.stats.get(stat, 0))
        yield family


def _histogram(name: str, doc: str, by_bucket: dict[str, dict[str, int]],
               bounds: tuple[float, ...], tags: tuple[str, ...],
               sum_tag: str) -> HistogramMetricFamily:
    """A per-queue histogram from its ``{ns}:runtime`` fields (``<tag>:<queue>`` -> count
    in that bucket, not cumulative; ``<sum_tag>:<queue>`` -> microseconds)."""
    family = HistogramMetricFamily(f"{PREFIX}_{name}", doc, labels=["queue"])
    queues = sorted({q for tag in tags for q in by_bucket.get(tag, {})})
    for queue in queues:
        cumulative, buckets = 0, []
        for bound, tag in zip((*bounds, float("inf")), tags, strict=True):
            cumulative += by_bucket.get(tag, {}).get(queue, 0)
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric([queue], buckets, by_bucket.get(sum_tag, {}).get(queue, 0) / 1e6)
    return family


class MetricsCollector(Collector):
    """A Prometheus collector over one namespace (``client``: a ``celery_ext.client.Client``).

    Redis unreachable: ``celery_ext_up`` is 0 and nothing else is reported, so a
    scrape still succeeds and an alert can say why (logged once per outage)."""

    def __init__(self, client: Any) -> None:
        self.state: State = client.state
        self._failing = False

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_up", "1 if the last scrape could read Redis.")
        try:
            snap = read_snapshot(self.state)
        except redis.RedisError as exc:
            if not self._failing:
                logger.warning("celery_ext metrics: cannot read Redis: %s", exc)
            self._failing = True
            up.add_metric([], 0)
            yield up
            return
        if self._failing:
            logger.warning("celery_ext metrics: Redis reachable again")
        self._failing = False
        up.add_metric([], 1)
        yield up
        yield from families(snap)


def registry_for(client: Any) -> CollectorRegistry:
    """A registry with only this namespace's collector (no process metrics of the
    serving process: several may serve one namespace)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(client))
    return registry
