"""Every Redis key and pub/sub channel name the plugin uses, built in one place.

All names start with ``{<tag>}:``; the braces make ``<tag>`` the Redis Cluster hash
tag, so the keys of one tag live in one hash slot and every script, which touches
the keys of one tag only, runs on a cluster as on one node.

*Kombu's ``global_keyprefix``* (setting ``global_keyprefix``, e.g. "app1:") goes before
every name: ``app1:{ns}:queue:<name>``, Kombu's own binding tables
(``app1:_kombu.binding.<exchange>``) and fanout channels (``app1:/0.<exchange>``)
alike, as Kombu's prefixing client would write them, so two apps with different
prefixes share a server without seeing each other's jobs. The prefix holds no brace,
so the hash tag stays the one in the braces. Every name is built here, whole: the
transport never uses Kombu's prefixing client, which prefixes only some commands'
keys (an ``EVALSHA``'s first key alone).

*One node* (the default): one tag, the namespace; the whole layout below is one copy.

*A cluster* (setting ``cluster``): every job queue has its own copy of the layout
under the tag ``<namespace>:<queue name>`` (``Keys.of(queue)``), so different job
queues land on different masters and every move of a job (queue, in-flight record,
scheduled and retry sets, dead set, unique lock, counters, job index) stays one
atomic script in one slot. What is namespace-wide stays in the namespace's own copy
(``Keys.home``): pool registrations and heartbeats, busy records, checkins, stop
requests, weights, the reaper lock, the requeuer lease, runtime histograms, history,
periodic entries, the registry of job queues (``queues``) and the hint of which
queues hold jobs (``ready``), both written beside the per-queue copies (the per-queue
copy's own ``queues``/``ready`` keep what its scripts write). Pub/sub channels are
not keys (a PUBLISH reaches every node): they are always the home copy's. In a
queue's copy, ``pools`` lists the pools that joined it (fetched from it; the reaper
removes a dead pool there, which makes its fetches refused) and ``requeuer`` is the
leader's id, refreshed by each promote. On one node ``home`` and ``of(queue)`` are
the one copy. See docs/cluster.md.

Layout (``ns`` = namespace)::

    {ns}:queue:<name>        list    a job queue; producers LPUSH, fetch RPOPs (FIFO); its
                                     jobs of the default priority level (0)
    {ns}:queue:<name>\x06\x16<level>
                             list    the same job queue's jobs of priority level <level>
                                     (one of priority_steps but 0; see priority.py): the
                                     queue key plus Kombu's Redis priority separator, so
                                     it carries whatever hash tag the queue key carries
    {ns}:queue:<name>\x06\x17  list  the job queue's ring of active fair keys (fair.py):
                                     each key whose sub-queue holds jobs, once; fetch
                                     rotates it (LMOVE); gone when no key has jobs
    {ns}:queue:<name>\x06\x17<key>
                             list    the sub-queue of one fair key (FIFO, every priority);
                                     gone when drained. Ring and sub-queues are the queue
                                     key plus a suffix: the queue key's hash tag
    {ns}:queue:<name>\x06\x18<key>
                             string  Redis time (µs) from which fair key <key>'s next job
                                     may be fetched (its fair_rate_limit, or a hold a job
                                     of it asked for: Throttled); expires at that time
    {ns}:ready               set     names of job queues that hold at least one job
    {ns}:queues              set     job queue names: added at enqueue (not Kombu's "*.pidbox"
                                     reply queues) and by the stats flush, forgotten by
                                     readers (queue_info.lua, with the queue's fields of
                                     stats and runtime) once the list is gone, unless
                                     paused, limited, weighted, in flight or consumed by a
                                     live pool (on a cluster also: unless its copy holds
                                     scheduled, retry, dead or index records, or joins)
    {ns}:weights             hash    queue name -> weight (written by worker pools)
    {ns}:wake                channel queue name, published when a queue becomes non-empty
    {ns}:pools               zset    pool id -> last heartbeat (Redis time, ms)
    {ns}:pool:<id>           hash    a pool's registration (host, pid, concurrency,
                                     its dead_after_ms and heartbeat_interval_ms, the job
                                     queues it consumes ("consumes"; liveness.py), ...)
    {ns}:inflight:<id>       hash    delivery tag -> "<queue>\\n<payload>" jobs a pool owns
    {ns}:inflight_pools      set     pool ids that may own in-flight jobs (finds orphans)
    {ns}:redelivery          hash    delivery tag -> times recovered from a dead pool
    {ns}:running             hash    queue name -> jobs of it in flight in all pools;
                                     "<queue>\n<fair key>" -> that key's jobs in flight
                                     (removed at 0; fair.py)
    {ns}:busy:<id>           hash    slot -> "<started ms>\n<job json>" jobs a pool runs now
    {ns}:checkins            hash    job id -> "<ms>\n<json>" last checkin of a running job
    {ns}:stop_requests       zset    job id -> ms when the request lapses: running jobs
                                     someone asked to stop (checkin returns True;
                                     stop_requests.py)
    {ns}:revoked             zset    task id -> ms when its revoke lapses (revoked_ttl): the
                                     ids a fetch drops instead of delivering (revoked.py;
                                     on a cluster written to every copy)
    {ns}:revoked_by          hash    task id -> "<meta json>" of its revoke (by, at,
                                     terminate), trimmed with {ns}:revoked
    {ns}:cursor:<task id>    string  "<owner delivery tag>\n<cursor json>": a resumable job's
                                     cursor (worker/cursor.py), in its job queue's copy,
                                     TTL cursor_ttl; removed by the ack of the run that
                                     owns it, by dead-lettering and by a poison pill
    {ns}:stats               hash    "processed"/"failed"/"retried"[":<queue>"] -> count; and
                                     "recovered" (jobs the reaper requeued), "pools_reaped",
                                     "poison_pills" (dead-lettered after max_recoveries),
                                     "unique_hits" (enqueues dropped as duplicates),
                                     "rate_limited"[":<queue>"] (fetches a rate limit refused)
    {ns}:runtime             hash    "<bucket>:<queue>" -> runs whose runtime fell in that
                                     bucket (not cumulative; see observer.RUNTIME_BUCKETS),
                                     "sum_us:<queue>" -> total runtime in microseconds;
                                     "wait_<bucket>:<queue>", "wait_sum_us:<queue>": the
                                     same for the wait from enqueue to start (wait_times.py)
    {ns}:reaper              string  lock held by the one reaper running a pass
    {ns}:dead                zset    dead job id -> failed_at (ms)
    {ns}:dead_jobs           hash    dead job id -> "<meta json>\n<queue>\n<payload>"
    {ns}:scheduled           zset    job id (delivery tag) -> due time (ms): countdown/eta jobs
    {ns}:retry               zset    job id -> due time (ms): retries of failed jobs (the retry set)
    {ns}:scheduled_jobs      hash    job id -> "<meta json>\n<queue>\n<payload>" for both sets
    {ns}:schedule            channel due time, published when a job is scheduled earlier
                                     than every other (wakes sleeping requeuers)
    {ns}:requeuer            string  id of the leading requeuer (a lease; see requeuer.py)
    {ns}:paused              set     job queue names that fetch skips (jobs kept)
    {ns}:limits              hash    queue name -> max jobs of it in flight at once;
                                     "<queue>\n" -> max jobs of one fair key in flight
    {ns}:rate_limits         hash    queue name -> rate limit as µs between two fetched jobs
                                     (cluster-wide, see rate_limits.py); "<queue>\n" ->
                                     µs between two jobs of one fair key (fair.py)
    {ns}:rate_tat            hash    queue name -> Redis time (µs) from which its next job
                                     may be fetched (GCRA "theoretical arrival time"), or
                                     until which a job held it (Throttled, throttle.lua)
    {ns}:unique:<digest>     string  id of the pending unique job with that key (TTL'd lock)
    {ns}:published:<id>      string  a publish that wrote its job (TTL publish_idempotency_ttl);
                                     Kombu's retry of that publish writes nothing. <id>: one
                                     per publish call and job queue (``producer.publish_marker``);
                                     on a cluster also "periodic:<run's job id>", one per
                                     periodic entry and due time (``periodic_run.run_marker``);
                                     a chord's body: one per chord apply and body task, kept
                                     for the chord expiry (``PUBLISH_ONCE``)
    {ns}:history:m:<minute>  hash    job counts, runtime histograms ("*", "n:<job name>") and a
                                     queue-size sample ("q") of one minute (ms // 60000);
                                     expires 24 h after it (see history.py)
    {ns}:history:h:<hour>    hash    the same per hour (ms // 3600000); expires after 30 days
    {ns}:jobs                hash    task id -> where the job is now (the job index, see
                                     job_index.py): "<state>\n<ms>\n<queue>\n<ref>\n<detail>"
                                     (done: "\n<queued ms>" after it), written by the
                                     script that moves the job
    {ns}:jobs_done           zset    task id -> ms after which its finished entry in
                                     {ns}:jobs is trimmed (job_index_ttl past the finish)
    {ns}:_kombu.binding.<exchange>, {ns}:_kombu.binding_permanent.<exchange>,
    {ns}:_kombu.binding_deadlines
                             Kombu's binding tables, on a cluster only (Kombu's own
                             names, without a tag, on one node; both after the
                             global_keyprefix)
    {ns}:periodic            set     names of the periodic job entries (the leader's beat_schedule
                                     and the runtime entries; worker/periodic_leader.py)
    {ns}:periodic:<name>     hash    one entry's state: next_due, last_due, last_run_at (ms),
                                     last_job_id, runs, missed, paused, outcome (+ its
                                     outcome_job_id), error, task, schedule, spec, source
                                     ("config" or "runtime")
    {ns}:periodic_runtime    hash    entry name -> JSON record of a periodic job entry set at
                                     runtime (task, every or crontab, args, kwargs, options;
                                     store/runtime_schedules.py); it wins over the app's
                                     beat_schedule entry of the same name
    {ns}:periodic_leader     string  id of the pool that enqueues the periodic jobs (a lease
                                     living the holder's dead_after; periodic_leader.py)
    {ns}:periodic_handover   channel published when the periodic leader gives up its lease
    {ns}:periodic_pushed:<name>
                             string  cluster, or a run with a countdown/eta, in a job queue's
                                     copy: the latest due time (ms) of entry <name> written
                                     there; enqueue.lua and schedule.lua write no run of
                                     that due time or an earlier one again
                                     (producer/periodic_run.py)

Result backend (``celery_ext/results/``; ``ResultKeys``). Each result carries the tag of its
own task id, so results spread over a cluster's masters; a group's and a chord's keys share
the group's tag, so each chord step is one script. Every one of them is written with a TTL::

    {ns:<task id>}:result    string  a task's result meta (Celery's encoding), TTL result_expires
    {ns:<group id>}:group    string  a saved GroupResult (GroupResult.save), TTL result_expires
    {ns:<group id>}:chord    hash    a pending chord: "size" (header jobs), "counted" (header
                                     results counted), "body_sent" (1 once the body was
                                     claimed), "error" (the reason it failed), TTL chord expiry
    {ns:<group id>}:chord_ids
                             set     task ids of the header results counted (a second run of
                                     a header job counts once), TTL chord expiry
    {ns:<group id>}:chord_results
                             zset    header results (Celery's encoding) scored by their place
                                     in the header, TTL chord expiry
    {ns}:pending_chords      zset    group id -> applied at (Redis ms): chords not yet settled, for
                                     the dashboard, the CLI and Client (an index written beside
                                     each chord's script: another slot on a cluster; readers
                                     drop entries whose chord settled or expired), TTL chord
                                     expiry
    {ns:client:<oid>}:results
                             channel a waiting client's wake-up channel (one per client
                                     thread, named by Celery's ``reply_to``): the storing
                                     worker publishes each result meta to it (SPUBLISH on a
                                     cluster, so it stays on the channel's shard)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from celery_ext.config import WAIT_BUCKETS

#: Fields of the ``stats`` hash counting reliability events (Prometheus counters).
STAT_RECOVERED = "recovered"
STAT_POOLS_REAPED = "pools_reaped"
STAT_POISON_PILLS = "poison_pills"
STAT_UNIQUE_HITS = "unique_hits"
#: Upper bounds (seconds) of the job runtime histogram's buckets, +Inf implied. Fixed:
#: the counts in ``{ns}:runtime`` are per bucket, so changing them splits history.
RUNTIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 300.0, 1800.0)
#: The ``{ns}:runtime`` field prefix of each bucket: its bound as written by repr().
RUNTIME_BUCKET_NAMES = (*(repr(b) for b in RUNTIME_BUCKETS), "inf")
#: Per-queue fields of ``{ns}:stats`` and ``{ns}:runtime``: ``"<prefix>:<queue>"``. They go
#: with the queue's name when a reader forgets it (``queue_info.lua``), so names that
#: come and go leave nothing behind.
QUEUE_STAT_PREFIXES = ("processed", "failed", "retried", "rate_limited")
#: The ``{ns}:runtime`` field prefix of each bucket of the queue wait-time histogram
#: (``config.WAIT_BUCKETS``): ``wait_`` and its bound as written by repr().
WAIT_BUCKET_NAMES = (*(f"wait_{b!r}" for b in WAIT_BUCKETS), "wait_inf")
#: The ``{ns}:runtime`` field prefix summing the waits (microseconds).
WAIT_SUM_PREFIX = "wait_sum_us"
QUEUE_RUNTIME_PREFIXES = (*RUNTIME_BUCKET_NAMES, "sum_us", *WAIT_BUCKET_NAMES, WAIT_SUM_PREFIX)
#: Between a job queue's key and a priority level in the key of that level's list:
#: Kombu's Redis separator (``redis.Channel.sep``). Lua scripts check level keys by it.
LEVEL_SEP = "\x06\x16"
#: Between a job queue's key and a fair key in the key of that key's sub-queue (and,
#: with nothing after it, the queue's ring of active keys). Lua scripts derive both
#: from the queue key by it (``store/lua/include/fair.lua``).
FAIR_SEP = "\x06\x17"
#: After a job queue's key, then a fair key: that key's "not due until" state.
FAIR_DUE_SEP = "\x06\x18"


@dataclass(frozen=True)
class Keys:
    """Key builder for one namespace, or (on a cluster) one job queue's copy of it."""

    namespace: str
    #: Job queues have copies of their own (``of``): the namespace runs on a cluster.
    cluster: bool = False
    #: The hash tag of this copy; "" = the namespace's home copy.
    tag: str = ""
    #: Kombu's ``global_keyprefix``: before every key and channel name ("" = none).
    keyprefix: str = ""

    @classmethod
    def for_settings(cls, settings: Any) -> Keys:
        """The home copy for a :class:`~celery_ext.config.Settings`."""
        return cls(settings.namespace, cluster=settings.cluster,
                   keyprefix=settings.global_keyprefix)

    @property
    def prefix(self) -> str:
        return self.keyprefix + "{" + (self.tag or self.namespace) + "}:"

    @property
    def _home_prefix(self) -> str:
        """The home copy's prefix: pub/sub channels and Kombu's tables on a cluster."""
        return self.keyprefix + "{" + self.namespace + "}:"

    @property
    def home(self) -> Keys:
        """The namespace's own copy: registrations, heartbeats, leases, registry."""
        return Keys(self.namespace, self.cluster, keyprefix=self.keyprefix) if self.tag else self

    def of(self, queue: str) -> Keys:
        """The copy that holds ``queue`` and every per-queue record (itself on one node)."""
        return _queue_copy(self.namespace, queue, self.keyprefix) if self.cluster else self

    def groups(self, queues: Iterable[str]) -> dict[Keys, list[str]]:
        """``queues`` by the copy holding them, in first-seen order (one group on one
        node): what one script call or one pipeline per copy covers."""
        out: dict[Keys, list[str]] = {}
        for q in queues:
            out.setdefault(self.of(q), []).append(q)
        return out

    # Kombu's binding keys. On a cluster under the home tag, so Kombu's binding scripts
    # (an expiring binding and its deadline in one call) touch one slot; on one node
    # Kombu's own names. Both after the global_keyprefix. Format strings as Kombu's
    # channel has them.
    @property
    def _kombu_prefix(self) -> str:
        return self._home_prefix if self.cluster else self.keyprefix

    @property
    def kombu_binding(self) -> str:
        return self._kombu_prefix + "_kombu.binding.%s"

    @property
    def kombu_binding_permanent(self) -> str:
        return self._kombu_prefix + "_kombu.binding_permanent.%s"

    @property
    def kombu_binding_deadlines(self) -> str:
        return self._kombu_prefix + "_kombu.binding_deadlines"

    def kombu_channel(self, topic: str) -> str:
        """Kombu's fanout pub/sub channel for ``topic`` (events, remote control)."""
        return self.keyprefix + topic

    def kombu_topic(self, channel: str) -> str:
        """Inverse of :meth:`kombu_channel` (a channel name as a message names it)."""
        return channel[len(self.keyprefix):] if channel.startswith(self.keyprefix) else channel

    @property
    def is_home(self) -> bool:
        return not self.tag

    @property
    def copy_queue(self) -> str | None:
        """The job queue whose copy this is (cluster); None for the home copy."""
        return self.tag[len(self.namespace) + 1:] if self.tag else None

    def queue(self, name: str) -> str:
        return f"{self.prefix}queue:{name}"

    def queue_level(self, name: str, level: int) -> str:
        """The list of one priority level of a job queue; level 0 is :meth:`queue`."""
        key = self.queue(name)
        return f"{key}{LEVEL_SEP}{level}" if level else key

    def queue_levels(self, name: str, steps: Sequence[int]) -> list[str]:
        """Every level list of a job queue, the first to run first (as fetch pops)."""
        key = self.queue(name)
        return [f"{key}{LEVEL_SEP}{level}" if level else key for level in steps]

    def fetch(self, pool_id: str, queues: Sequence[str], steps: Sequence[int]) -> list[str]:
        """KEYS of one ``fetch.lua`` call for ``pool_id`` ("-": no-ack) over ``queues``
        (candidates, repeats allowed): the fixed keys, then each candidate's level lists."""
        return [self.inflight(pool_id), self.pools, self.ready, self.redelivery,
                self.inflight_pools, self.running, self.limits, self.paused, self.rate_limits,
                self.rate_tat, self.stats, self.job_index, self.revoked, self.revoked_by,
                self.dead, self.dead_jobs, self.job_index_done,
                *(key for q in queues for key in self.queue_levels(q, steps))]
    def fair_ring(self, name: str) -> str:
        """The ring of a job queue's active fair keys (:mod:`.fair`)."""
        return f"{self.queue(name)}{FAIR_SEP}"

    def fair_queue(self, name: str, key: str) -> str:
        """The sub-queue of one fair key of a job queue (:mod:`.fair`)."""
        return f"{self.queue(name)}{FAIR_SEP}{key}"

    def fair_due(self, name: str, key: str) -> str:
        """When one fair key of a job queue may have its next job fetched (:mod:`.fair`)."""
        return f"{self.queue(name)}{FAIR_DUE_SEP}{key}"

    @staticmethod
    def queue_fields(queue: str) -> tuple[list[str], list[str]]:
        """The fields of ``queue`` in the ``stats`` and in the ``runtime`` hash."""
        return ([f"{p}:{queue}" for p in QUEUE_STAT_PREFIXES],
                [f"{p}:{queue}" for p in QUEUE_RUNTIME_PREFIXES])

    def queue_name(self, key: str) -> str:
        """Inverse of :meth:`queue`."""
        return key[len(self.prefix) + len("queue:"):]

    @property
    def ready(self) -> str:
        return self.prefix + "ready"

    @property
    def queues(self) -> str:
        return self.prefix + "queues"

    @property
    def weights(self) -> str:
        return self.prefix + "weights"

    @property
    def wake_channel(self) -> str:
        return self._home_prefix + "wake"  # a channel, not a key: always the home's

    @property
    def pools(self) -> str:
        return self.prefix + "pools"

    def pool(self, pool_id: str) -> str:
        return f"{self.prefix}pool:{pool_id}"

    def inflight(self, pool_id: str) -> str:
        return f"{self.prefix}inflight:{pool_id}"

    @property
    def inflight_pools(self) -> str:
        return self.prefix + "inflight_pools"

    @property
    def redelivery(self) -> str:
        return self.prefix + "redelivery"

    @property
    def reaper_lock(self) -> str:
        return self.prefix + "reaper"

    def busy(self, pool_id: str) -> str:
        return f"{self.prefix}busy:{pool_id}"

    @property
    def checkins(self) -> str:
        return self.prefix + "checkins"

    @property
    def stop_requests(self) -> str:
        return self.prefix + "stop_requests"

    def cursor(self, job_id: str) -> str:
        """A resumable job's cursor, by task id, in its job queue's copy (``of``)."""
        return f"{self.cursor_prefix}{job_id}"

    @property
    def cursor_prefix(self) -> str:
        """:meth:`cursor` without the task id: the scripts that end a job (ack, dead,
        recover) find its id in its payload and drop its cursor by this prefix."""
        return self.prefix + "cursor:"

    @property
    def revoked(self) -> str:
        return self.prefix + "revoked"

    @property
    def revoked_by(self) -> str:
        return self.prefix + "revoked_by"

    @property
    def stats(self) -> str:
        return self.prefix + "stats"

    @property
    def runtime(self) -> str:
        return self.prefix + "runtime"

    @property
    def running(self) -> str:
        return self.prefix + "running"

    @property
    def dead(self) -> str:
        return self.prefix + "dead"

    @property
    def dead_jobs(self) -> str:
        return self.prefix + "dead_jobs"

    @property
    def scheduled(self) -> str:
        return self.prefix + "scheduled"

    @property
    def retry(self) -> str:
        return self.prefix + "retry"

    @property
    def scheduled_jobs(self) -> str:
        return self.prefix + "scheduled_jobs"

    @property
    def schedule_channel(self) -> str:
        return self._home_prefix + "schedule"  # a channel: always the home's

    @property
    def requeuer_lease(self) -> str:
        return self.prefix + "requeuer"

    @property
    def paused(self) -> str:
        return self.prefix + "paused"

    @property
    def limits(self) -> str:
        return self.prefix + "limits"

    @property
    def rate_limits(self) -> str:
        return self.prefix + "rate_limits"

    @property
    def rate_tat(self) -> str:
        return self.prefix + "rate_tat"

    def unique(self, digest: str) -> str:
        return f"{self.prefix}unique:{digest}"

    def published(self, marker: str) -> str:
        return f"{self.prefix}published:{marker}"

    def history_minute(self, minute: int) -> str:
        return f"{self.prefix}history:m:{minute}"

    def history_hour(self, hour: int) -> str:
        return f"{self.prefix}history:h:{hour}"

    @property
    def job_index(self) -> str:
        return self.prefix + "jobs"

    @property
    def job_index_done(self) -> str:
        return self.prefix + "jobs_done"

    @property
    def periodic(self) -> str:
        return self.prefix + "periodic"

    def periodic_entry(self, name: str) -> str:
        return f"{self.prefix}periodic:{name}"

    @property
    def periodic_runtime(self) -> str:
        return self.prefix + "periodic_runtime"

    @property
    def periodic_leader(self) -> str:
        return self.prefix + "periodic_leader"

    @property
    def periodic_handover(self) -> str:
        return self._home_prefix + "periodic_handover"  # a channel: always the home's

    def periodic_pushed(self, name: str) -> str:
        """A job queue's copy's record of the entry's latest due time pushed (cluster)."""
        return f"{self.prefix}periodic_pushed:{name}"


@lru_cache(maxsize=4096)
def _queue_copy(namespace: str, queue: str, keyprefix: str = "") -> Keys:
    """A job queue's copy of the layout on a cluster: tag ``<namespace>:<queue>``. A
    ``}`` in the name ends the tag early, the same way for every key of the copy."""
    return Keys(namespace, cluster=True, tag=f"{namespace}:{queue}", keyprefix=keyprefix)


@dataclass(frozen=True)
class ResultKeys:
    """Keys of the result backend (``celery_ext/results/``) in one namespace.

    Unlike the broker's layout there is no home copy: every result is tagged by its own
    task id (or its group's id), on one node as on a cluster, so a backend that moves to a
    cluster keeps its layout and each chord step touches the one slot of its group."""

    namespace: str
    #: Kombu's ``global_keyprefix`` of ``result_backend_transport_options``, before every
    #: key and channel name ("" = none), as the broker's ``Keys`` put it.
    keyprefix: str = ""

    def _of(self, ident: str) -> str:
        return self.keyprefix + "{" + self.namespace + ":" + ident + "}:"

    def result(self, task_id: str) -> str:
        return self._of(task_id) + "result"

    def group(self, group_id: str) -> str:
        return self._of(group_id) + "group"

    def chord(self, group_id: str) -> str:
        return self._of(group_id) + "chord"

    def chord_ids(self, group_id: str) -> str:
        return self._of(group_id) + "chord_ids"

    def chord_results(self, group_id: str) -> str:
        return self._of(group_id) + "chord_results"

    def chord_keys(self, group_id: str) -> list[str]:
        """KEYS of ``chord_part.lua`` for the chord of ``group_id`` (one slot)."""
        return [self.chord(group_id), self.chord_ids(group_id), self.chord_results(group_id)]

    @property
    def pending_chords(self) -> str:
        return self.keyprefix + "{" + self.namespace + "}:pending_chords"

    def wake_channel(self, oid: str) -> str:
        """The wake-up channel of a waiting client (its Celery ``reply_to``)."""
        return self.keyprefix + "{" + self.namespace + ":client:" + oid + "}:results"

    @property
    def pattern(self) -> str:
        """SCAN pattern matching every key of this namespace's results (tests, admin)."""
        return self.keyprefix + "{" + self.namespace + ":*}:*"
