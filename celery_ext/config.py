"""Settings and their named defaults: the one place timings live.

Every interval the plugin uses is a field of :class:`Settings`. Values come, in
order of precedence, from environment variables ``CELERY_EXT_<FIELD>`` (so tests
can shrink every timing of a worker subprocess at once), then from the broker
transport options (``app.conf.broker_transport_options``), then the defaults
below.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

#: Prefix of every Redis key and pub/sub channel; also the Redis Cluster hash tag.
DEFAULT_NAMESPACE = "celery_ext"
#: Kombu's ``global_keyprefix`` transport option: written before every key and pub/sub
#: channel, the plugin's and Kombu's own, so apps sharing one server keep apart. "" = none.
DEFAULT_GLOBAL_KEYPREFIX = ""
#: Seconds between two heartbeats of a worker pool.
DEFAULT_HEARTBEAT_INTERVAL = 5.0
#: A pool whose last heartbeat is older than this (by Redis time) is dead.
DEFAULT_DEAD_AFTER = 30.0
#: Seconds between two reaper passes in each pool (jittered by +/-20%).
DEFAULT_REAP_INTERVAL = 10.0
#: An idle pool re-reads which job queues hold jobs this often, in case a wake-up
#: notification was missed (pub/sub is at-most-once). Its only idle command.
DEFAULT_IDLE_REFRESH_INTERVAL = 1.0
#: While Redis cannot be reached, a job's process tries its busy records, checkins and
#: counters again this often (seconds); meanwhile they wait in memory and a checkin
#: answers from what it last heard, so an outage costs the jobs no round trips.
OBSERVER_RETRY_INTERVAL = 1.0
#: Upper bounds (seconds) of the queue wait-time histogram's buckets (a job's enqueue, or
#: its due time, to the start of its run), +Inf implied: from an idle queue's milliseconds
#: to a backlog's hour. Fixed: ``{ns}:runtime`` counts per bucket, so changing them splits
#: the history Prometheus holds (``celery_ext_job_wait_seconds``, worker/wait_times.py).
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                600.0, 1800.0, 3600.0)
#: A job recovered from dead pools more often than this goes to the dead set.
DEFAULT_MAX_RECOVERIES = 3
#: Weight of a job queue whose task sets none.
DEFAULT_WEIGHT = 1
#: The dead set keeps at most this many jobs (oldest trimmed first)...
DEFAULT_DEAD_MAX_SIZE = 10_000
#: ...and none older than this many seconds (180 days).
DEFAULT_DEAD_MAX_AGE = 180 * 24 * 3600.0
#: Largest value of any time setting (100 years, in seconds): the scripts take times as
#: whole milliseconds, which a larger value (1e305 passes as finite) would overflow.
MAX_SECONDS = 100 * 365 * 24 * 3600.0
#: Longest an ack made in a worker's event loop waits to be written (seconds). The loop's
#: acks go in one call with those of the next turns (worker/ack_batcher.py): a prefork
#: pool's main process acks each job in a turn of its own, one call per job otherwise.
#: What waits on a job's ack: its in-flight entry (a pool killed meanwhile has the job
#: run again), its "done" in the job index, its unique lock ("until finished").
LOOP_ACK_DELAY = 0.005
#: Acks of the event loop waiting that are written at its next turn, whatever their age.
LOOP_ACKS_PER_CALL = 16
#: Most messages one fetch round trip may move into the in-flight record.
DEFAULT_FETCH_BATCH = 16
#: A channel's connections per client under gevent's monkey-patching (Kombu's default is
#: 10). Every job is a greenlet of the main process and may hold one of our clients'
#: connections (a failed job's dead record, a unique lock's release, a checkin) while it
#: waits for the reply: the cap is the server's (Redis's default ``maxclients``), not
#: ours, since a greenlet finding none free fails its job's bookkeeping.
GREEN_MAX_CONNECTIONS = 10_000
#: Longest an idle requeuer waits between two promote passes. It also wakes at the
#: next due time and when a job is scheduled earlier (pub/sub): this is the safety net.
DEFAULT_PROMOTE_INTERVAL = 5.0
#: Shortest gap between two promote passes of one pool: jobs falling due within it
#: are promoted together, so a dense schedule costs passes per second, not per job.
DEFAULT_PROMOTE_MIN_INTERVAL = 0.02
#: Most due jobs one promote script call moves from the scheduled/retry sets.
DEFAULT_PROMOTE_BATCH = 100
#: Seconds a unique job's lock lives past its due time if nobody releases it.
DEFAULT_UNIQUE_TTL = 3600.0
#: Most jobs a worker lists in its reply to ``celery inspect scheduled`` (the first by
#: due time of the scheduled and retry sets: the reply is one message on the bus).
INSPECT_SCHEDULED_MAX = 1000
#: Most pages of ``INSPECT_SCHEDULED_MAX`` jobs that reply reads from each set, looking for
#: jobs of the worker's queues among the other queues' (bounded work per reply).
INSPECT_SCHEDULED_PAGES = 10
#: Opt-in retry backoff (task option ``backoff=True``): first delay in seconds...
DEFAULT_RETRY_BACKOFF_BASE = 2.0
#: ...doubled per attempt up to this many seconds...
DEFAULT_RETRY_BACKOFF_MAX = 3600.0
#: ...and shortened by up to this fraction at random, so retries of a burst spread out.
DEFAULT_RETRY_BACKOFF_JITTER = 0.25
#: Largest encoded job (bytes) a producer may enqueue; a bigger one raises
#: ``PayloadTooLarge`` and writes nothing. 0 = no limit. Jobs sit in Redis memory and
#: one fetch moves up to ``fetch_batch`` of them in one reply: pass references to
#: large data, not the data.
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
#: Seconds a publish is remembered after its job was written: a publish that Kombu
#: retries within this time (its write landed, the reply was lost) writes nothing
#: again. Celery's default publish retry policy gives up well within it. Costs one
#: key (about 100 bytes) per job enqueued in that time; 0 = off (at-least-once).
DEFAULT_PUBLISH_IDEMPOTENCY_TTL = 120.0
#: Jobs written per round trip by a bulk publish (``celery_ext.bulk``, ``apply_many``, a
#: group under ``install(app)``, Kombu's ``Producer.batch()``): each round trip is one
#: pipeline of that many script calls, so no reply grows with the bulk and Redis runs
#: other clients' commands between any two jobs' scripts.
BULK_PIPELINE_SIZE = 1000
#: A bulk's retry policy when the app's says nothing (Celery's defaults): a round trip
#: that failed is sent again, and each job's publish marker makes it a no-op for the
#: jobs its first attempt wrote.
BULK_RETRY_POLICY: dict[str, float] = {"max_retries": 3, "interval_start": 0.0,
                                       "interval_step": 0.2, "interval_max": 0.2}
#: Seconds between two queue-size samples of the history (taken by the leading
#: requeuer; the plots keep the last sample of each minute and hour).
DEFAULT_HISTORY_SAMPLE_INTERVAL = 60.0
#: Whether worker pools run the app's ``beat_schedule`` and the periodic entries set at
#: runtime (the pool holding the periodic lease enqueues each due run; see
#: ``worker/periodic_leader.py``).
DEFAULT_PERIODIC = True
#: A periodic due time later than this many seconds is *missed*, as is one that a later
#: due time of its entry overtook (a leader failover, every pool down).
DEFAULT_PERIODIC_GRACE = 30.0
#: What the leader does with missed due times: "once" enqueues one run for all of
#: them, "skip" none (the latest still runs if not later than the grace), "all" one each.
DEFAULT_PERIODIC_MISSED = "once"
#: The values ``periodic_missed`` accepts.
PERIODIC_MISSED_POLICIES = ("once", "skip", "all")
#: Priority levels of a job queue (Kombu's Redis ``priority_steps``): a job's
#: ``priority`` (0-9, lower runs first) is rounded down to one of these; each level is
#: one list per job queue. Must start at 0 (the default level) and rise within 0-9.
DEFAULT_PRIORITY_STEPS = (0, 3, 6, 9)

#: Longest wait (seconds) for a Redis reply, even from a server that seems stalled (the
#: probe below goes unanswered too), before the connection counts as lost: a fetch
#: unanswered this long is abandoned and sent again on a new connection, and it is the
#: socket timeout of the plugin's connections unless ``socket_timeout`` is set. Well
#: over the stalls a server lives through (DEBUG SLEEP, a blocking fork, a long
#: script), so they cost no reconnect; a silent connection to a live server is noticed
#: much sooner, by the probe.
DEFAULT_REPLY_TIMEOUT = 60.0
#: A reply overdue this long (seconds) makes the process probe the server on a fresh
#: connection (``store/probe.py``). Answered, the server is live and the silent
#: connection dead (half-open: a NAT or load balancer dropped its state): it is dropped
#: and its request given up as lost, which the fetch, ack and publish paths recover.
#: Unanswered, the server is stalled: the connection waits on, up to ``reply_timeout``.
DEFAULT_REPLY_PROBE_AFTER = 3.0
#: Longest wait (seconds) for the probe's answer (connect and reply); a slower one
#: means the server is stalled.
DEFAULT_PROBE_TIMEOUT = 2.0
#: An answered probe convicts a silent connection only once that connection's own
#: reply, written by the server no later than the probe's, has had this long to arrive.
PROBE_GRACE = 0.25
#: After an unanswered probe (a stalled server) the next one waits twice as long, up to
#: this many seconds: a long stall costs a process a few probe connections, not a storm.
PROBE_BACKOFF_MAX = 8.0
#: Longest wait (seconds) for a TCP connection to Redis unless ``socket_connect_timeout``
#: is set: a server that is up completes the handshake at once, even when stalled (its
#: kernel accepts), so a slower one is unreachable.
DEFAULT_CONNECT_TIMEOUT = 10.0
#: TCP keep-alive of every connection unless ``socket_keepalive`` is set: first probe
#: after this many idle seconds, then one every KEEPALIVE_INTERVAL, the connection
#: closed after KEEPALIVE_COUNT unanswered (Linux; elsewhere the system's timings).
#: It finds a vanished peer on connections that wait for no reply (pub/sub).
KEEPALIVE_IDLE = 10
KEEPALIVE_INTERVAL = 5
KEEPALIVE_COUNT = 3
#: Replicas that must acknowledge a job's enqueue (Redis ``WAIT``) before the publish
#: returns; 0 = do not wait (asynchronous replication: a failover may lose the last jobs).
DEFAULT_WAIT_REPLICAS = 0
#: Longest ``WAIT`` for those replicas, in milliseconds; fewer in time raise ``NotReplicated``.
DEFAULT_WAIT_TIMEOUT_MS = 1000
#: Whether the scripts that move a job keep the job index (task id -> where the job is
#: now; see ``job_index.py``): one hash field per job, written in the same script as
#: each move. Off, a job's status is searched for in the sets (slower, incomplete).
DEFAULT_JOB_INDEX = True
#: Seconds a finished job's index entry (done, when, which pool) is kept.
DEFAULT_JOB_INDEX_TTL = 3600.0
#: Seconds a request to stop a running job holds (its checkins answer "stop" until the
#: job ends or this passes): the bound on entries whose job's end nobody reports.
DEFAULT_STOP_REQUEST_TTL = 24 * 3600.0
#: Seconds a revoked task id is kept in Redis (every fetch drops a job with that id, so a
#: job enqueued, promoted or retried later does not run): Celery's ``REVOKE_EXPIRES``.
DEFAULT_REVOKED_TTL = 10800.0
#: Most revoked ids kept per copy (the oldest go first): Celery's ``REVOKES_MAX``.
DEFAULT_REVOKED_MAX = 50_000
#: Most jobs of a level list a revoke reads, from the fetch's end, to find a queued job
#: it revokes (revoke.lua: 15-17 ms of Redis time for 10,000 jobs of 1 kB, measured); one
#: further back is left to the fetch that pops it (fetch.lua drops a revoked id).
REVOKE_SCAN_MAX = 10_000

#: Bytes a resumable job's cursor may take as JSON (``checkin(cursor=...)``): a cursor is a
#: position (an id, an offset, a page token), not the job's data; a larger one is refused
#: at its checkin with one error line, and the job runs on.
DEFAULT_CURSOR_MAX_BYTES = 4096
#: Seconds a resumable job's cursor is kept after its last write: the bound on a cursor
#: whose job nobody finishes (purged from its queue, lost with its data), as Sidekiq keeps
#: an iterable job's state for 30 days.
DEFAULT_CURSOR_TTL = 30 * 24 * 3600.0
#: A job writes its cursor at most this often (seconds; 0 = at every checkin); the last
#: one is always written when the job is asked to stop or ends without finishing. A crash
#: redoes at most the steps of this interval.
DEFAULT_CURSOR_INTERVAL = 1.0
#: Seconds a stored result (and a saved group) lives when ``result_expires`` is unset or 0:
#: Celery's own default, since the result backend stores nothing without a TTL.
DEFAULT_RESULT_EXPIRES = 24 * 3600
#: A client waiting for results re-reads the pending ones (one MGET) this often when no
#: wake-up arrived: pub/sub is at-most-once, and a result sent by another process (or
#: stored before this thread subscribed) publishes nowhere this client listens.
RESULT_POLL_INTERVAL = 0.5
#: A waiting client whose wake-up subscription broke (a failover, a restart) waits this
#: many seconds before it subscribes again, re-reading its pending results meanwhile: an
#: attempt on a node that just died can block for seconds in redis-py's retries.
RESULT_RESUBSCRIBE_AFTER = 2.0
#: A result backend shared by threads on a cluster listens on one subscription per shard
#: its threads' channels live on; it waits on each in turn this many seconds at a time,
#: so a wake-up on any shard is read within about this times the number of shards.
RESULT_SHARD_READ_SLICE = 0.01
#: Longest a chord's counting keys live past their last header result (seconds), when
#: neither ``result_chord_expires`` nor ``result_expires`` says otherwise.
DEFAULT_CHORD_EXPIRES = 24 * 3600
#: Most seconds the demo's ``--seconds`` run waits, past its end, for a job to finish and
#: the periodic job to run before it calls the run failed (its ``--verdict-wait``): a
#: periodic job due every 10 s may be due just as the run ends.
DEMO_VERDICT_WAIT = 15.0

_ENV_PREFIX = "CELERY_EXT_"
_NAMESPACE_RE = re.compile(r"\A[A-Za-z0-9_.:-]{1,64}\Z")  # not "$": it accepts a trailing newline
_KEYPREFIX_RE = re.compile(r"\A[A-Za-z0-9_.:/-]{0,64}\Z")


class ConfigError(ValueError):
    """A setting has a value the plugin cannot work with; the message says which."""


@dataclass(frozen=True)
class Settings:
    """All tunables of one transport/worker, validated at construction."""

    namespace: str = DEFAULT_NAMESPACE
    #: Kombu's option of that name (``store/keys.py``: before every key and channel).
    global_keyprefix: str = DEFAULT_GLOBAL_KEYPREFIX
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    dead_after: float = DEFAULT_DEAD_AFTER
    reap_interval: float = DEFAULT_REAP_INTERVAL
    idle_refresh_interval: float = DEFAULT_IDLE_REFRESH_INTERVAL
    max_recoveries: int = DEFAULT_MAX_RECOVERIES
    default_weight: int = DEFAULT_WEIGHT
    fetch_batch: int = DEFAULT_FETCH_BATCH
    dead_max_size: int = DEFAULT_DEAD_MAX_SIZE
    dead_max_age: float = DEFAULT_DEAD_MAX_AGE
    promote_interval: float = DEFAULT_PROMOTE_INTERVAL
    promote_min_interval: float = DEFAULT_PROMOTE_MIN_INTERVAL
    promote_batch: int = DEFAULT_PROMOTE_BATCH
    unique_ttl: float = DEFAULT_UNIQUE_TTL
    retry_backoff_base: float = DEFAULT_RETRY_BACKOFF_BASE
    retry_backoff_max: float = DEFAULT_RETRY_BACKOFF_MAX
    retry_backoff_jitter: float = DEFAULT_RETRY_BACKOFF_JITTER
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    reply_timeout: float = DEFAULT_REPLY_TIMEOUT
    reply_probe_after: float = DEFAULT_REPLY_PROBE_AFTER
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT
    publish_idempotency_ttl: float = DEFAULT_PUBLISH_IDEMPOTENCY_TTL
    history_sample_interval: float = DEFAULT_HISTORY_SAMPLE_INTERVAL
    periodic: bool = DEFAULT_PERIODIC
    periodic_grace: float = DEFAULT_PERIODIC_GRACE
    periodic_missed: str = DEFAULT_PERIODIC_MISSED
    wait_replicas: int = DEFAULT_WAIT_REPLICAS
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS
    priority_steps: tuple[int, ...] = DEFAULT_PRIORITY_STEPS
    job_index: bool = DEFAULT_JOB_INDEX
    job_index_ttl: float = DEFAULT_JOB_INDEX_TTL
    stop_request_ttl: float = DEFAULT_STOP_REQUEST_TTL
    revoked_ttl: float = DEFAULT_REVOKED_TTL
    revoked_max: int = DEFAULT_REVOKED_MAX
    cursor_max_bytes: int = DEFAULT_CURSOR_MAX_BYTES
    cursor_ttl: float = DEFAULT_CURSOR_TTL
    cursor_interval: float = DEFAULT_CURSOR_INTERVAL
    #: The broker is a Redis/Valkey Cluster (``broker_transport_options={"cluster":
    #: True}``): job queues spread over its shards (keys.py, docs/cluster.md).
    cluster: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", float) and not (isinstance(value, int | float)
                                                   and math.isfinite(value)
                                                   and abs(value) <= MAX_SECONDS):
                raise ConfigError(f"celery_ext: {f.name} must be a finite number of at most "
                                  f"{MAX_SECONDS:.0f} seconds, got {value!r}")
        if not _NAMESPACE_RE.match(self.namespace):
            raise ConfigError(
                f"celery_ext: namespace {self.namespace!r} must be 1-64 characters of "
                "letters, digits and _ . : - (no braces: it becomes the Redis hash tag)"
            )
        if not _KEYPREFIX_RE.match(self.global_keyprefix):
            raise ConfigError(
                f"celery_ext: global_keyprefix {self.global_keyprefix!r} must be at most 64 "
                "characters of letters, digits and _ . : / - (no braces or spaces: a brace "
                "would change the Redis Cluster hash tag of every key)")
        for name in ("heartbeat_interval", "dead_after", "reap_interval", "idle_refresh_interval",
                     "promote_interval", "unique_ttl", "retry_backoff_base",
                     "retry_backoff_max", "reply_timeout", "reply_probe_after",
                     "probe_timeout", "history_sample_interval", "job_index_ttl",
                     "stop_request_ttl", "revoked_ttl", "cursor_ttl"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"celery_ext: {name} must be > 0, got {getattr(self, name)!r}")
        if self.dead_after < 2 * self.heartbeat_interval:
            raise ConfigError(
                f"celery_ext: dead_after ({self.dead_after}) must be at least twice "
                f"heartbeat_interval ({self.heartbeat_interval}), or live pools would be reaped"
            )
        if self.dead_max_size < 1 or self.dead_max_age <= 0:
            raise ConfigError("celery_ext: dead_max_size must be >= 1 and dead_max_age > 0")
        if self.revoked_max < 1:
            raise ConfigError(f"celery_ext: revoked_max must be >= 1, got {self.revoked_max!r}")
        if self.max_recoveries < 0 or self.default_weight < 1 or self.fetch_batch < 1:
            raise ConfigError(
                "celery_ext: max_recoveries must be >= 0, default_weight >= 1 and fetch_batch >= 1"
            )
        if self.promote_batch < 1 or not 0 <= self.retry_backoff_jitter <= 1 \
                or not 0 <= self.promote_min_interval <= self.promote_interval:
            raise ConfigError(
                "celery_ext: promote_batch must be >= 1, retry_backoff_jitter in [0, 1] and "
                "promote_min_interval between 0 and promote_interval")
        if self.max_payload_bytes < 0:
            raise ConfigError(f"celery_ext: max_payload_bytes must be >= 0 (0 = no limit), "
                              f"got {self.max_payload_bytes!r}")
        if self.publish_idempotency_ttl < 0:
            raise ConfigError("celery_ext: publish_idempotency_ttl must be >= 0 (0 = off), "
                              f"got {self.publish_idempotency_ttl!r}")
        if self.periodic_grace < 0 or self.periodic_missed not in PERIODIC_MISSED_POLICIES:
            raise ConfigError("celery_ext: periodic_grace must be >= 0 and periodic_missed one "
                              f"of {', '.join(PERIODIC_MISSED_POLICIES)}, got "
                              f"{self.periodic_grace!r} and {self.periodic_missed!r}")
        if self.wait_replicas < 0 or self.wait_timeout_ms <= 0:
            raise ConfigError("celery_ext: wait_replicas must be >= 0 and wait_timeout_ms > 0 "
                              "(WAIT with 0 would block forever), got "
                              f"{self.wait_replicas!r} and {self.wait_timeout_ms!r}")
        if self.cursor_max_bytes < 1 or self.cursor_interval < 0:
            raise ConfigError("celery_ext: cursor_max_bytes must be >= 1 and cursor_interval "
                              f">= 0, got {self.cursor_max_bytes!r} and {self.cursor_interval!r}")
        steps = self.priority_steps
        if (not isinstance(steps, tuple) or not steps or steps[0] != 0 or steps[-1] > 9
                or any(type(s) is not int for s in steps)
                or any(a >= b for a, b in itertools.pairwise(steps))):
            raise ConfigError(
                "celery_ext: priority_steps must be rising whole numbers from 0 up to at most "
                f"9, e.g. [0, 3, 6, 9]; got {steps!r}")

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def load(cls, options: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from transport options overlaid with ``CELERY_EXT_*`` variables."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for name in types:
            if options and name in options:
                values[name] = options[name]
            env = environ.get(_ENV_PREFIX + name.upper())
            if env is not None:
                values[name] = env
        for name, raw in list(values.items()):
            kind = types[name]
            try:
                if isinstance(raw, bool) and kind in ("float", float, "int", int):
                    raise TypeError("a boolean is not a number")
                if kind in ("bool", bool):
                    values[name] = _bool(raw)
                elif kind in ("float", float):
                    values[name] = float(raw)
                elif kind in ("int", int):
                    if isinstance(raw, float) and not raw.is_integer():
                        raise ValueError("not a whole number")
                    values[name] = int(raw)
                elif name == "priority_steps":
                    values[name] = _int_tuple(raw)
                else:
                    values[name] = str(raw)
            except (TypeError, ValueError, OverflowError):
                what = {"int": "a whole number", "bool": "true or false"}.get(str(kind),
                                                                            f"a {kind}")
                if name == "priority_steps":
                    what = "a list of whole numbers"
                raise ConfigError(
                    f"celery_ext: setting {name} must be {what}, got {raw!r}"
                ) from None
        return cls(**values)

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)


def _bool(raw: Any) -> bool:
    """A switch from transport options (a bool or 0/1) or the environment ("true", "0")."""
    if isinstance(raw, bool) or raw in (0, 1):
        return bool(raw)
    text = str(raw).strip().lower() if isinstance(raw, str) else None
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a switch")
def _int_tuple(raw: Any) -> tuple[int, ...]:
    """A list of whole numbers from a transport option (a list) or an environment
    variable ("0,3,6,9")."""
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    out = []
    for item in items:
        if isinstance(item, bool) or (isinstance(item, float) and not item.is_integer()):
            raise ValueError("not a whole number")
        out.append(int(item))
    return tuple(out)


#: URL schemes of this transport (plain and TLS), and the redis-py scheme of each.
SCHEME = "celery-ext"
TLS_SCHEME = "celery-exts"
REDIS_SCHEMES = {SCHEME: "redis", TLS_SCHEME: "rediss"}
#: The same through Redis Sentinel (``;``-separated sentinel URLs, see ``connections``).
SENTINEL_SCHEME = f"{SCHEME}+sentinel"
TLS_SENTINEL_SCHEME = f"{TLS_SCHEME}+sentinel"
#: Every URL scheme of this transport.
OUR_SCHEMES = (SCHEME, TLS_SCHEME, SENTINEL_SCHEME, TLS_SENTINEL_SCHEME)


def redis_url(url: str) -> str:
    """``url`` with our scheme replaced by redis-py's (``celery-exts`` -> ``rediss``);
    any other URL unchanged."""
    scheme, sep, rest = url.partition("://")
    return f"{REDIS_SCHEMES.get(scheme, scheme)}{sep}{rest}"


def uses_our_transport(conf: Any) -> bool:
    """Whether the app's broker is this plugin's transport (by scheme or by
    ``broker_transport``)."""
    urls = [u for u in (conf.broker_url, conf.broker_read_url, conf.broker_write_url)
            if isinstance(u, str) and u]
    if any(u.startswith(tuple(f"{s}:" for s in OUR_SCHEMES)) for u in urls):
        return True
    return str(conf.broker_transport or "").startswith("celery_ext.")


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``**`` (parses nothing, so it works on
    URLs too broken for Kombu to mask)."""
    return _PASSWORD_RE.sub(r"\1**@", url)


# Up to the last "@": a password with an unescaped "/" or "@" is masked whole.
_PASSWORD_RE = re.compile(r"(://[^:/@\s;]*:)[^\s;]*@")


def unreadable_scheme(url: str = "") -> str:
    """Why a URL's scheme names no transport when urlparse reads none in it (an
    underscore: ``celery_ext://``); Kombu alone would say "No such transport: "."""
    written = url.partition("://")[0] if "://" in url else ""
    shown = f"scheme {written!r}" if written else "the URL's scheme"
    return (f"{shown} cannot be read (letters, digits, + - . only): ours is {SCHEME}:// "
            f"(or {TLS_SCHEME}://)")


def check_broker_url(url: str, transport: str | None = None) -> None:
    """Raise ConfigError (one line, password masked) for a broker URL Kombu cannot
    use: unknown scheme, port or db that is not a number. ``transport`` is
    ``broker_transport`` when set (it replaces the scheme)."""
    from kombu.transport import resolve_transport
    from kombu.utils.url import url_to_parts

    for one in url.split(";"):
        one = one.strip()
        shown = mask_url(one)
        if "://" not in one:
            continue  # a bare transport name ("redis"): Kombu's defaults apply
        try:
            parts = url_to_parts(one)
        except ValueError:
            # Not Python's message: on a password with an unescaped "/" it quotes part of it.
            raise ConfigError(
                f"celery_ext: broker URL {shown}: cannot read host:port (the port must be a "
                "whole number 0-65535; percent-encode / @ : in a password)") from None
        if not (transport or parts.scheme):
            raise ConfigError(f"celery_ext: broker URL {shown}: {unreadable_scheme(one)}")
        try:
            cls = resolve_transport(transport or parts.scheme)
        except (KeyError, ImportError, AttributeError) as exc:
            reason = exc.args[0] if exc.args else exc
            raise ConfigError(f"celery_ext: broker URL {shown}: {reason}") from None
        redis_like = cls is not None and getattr(cls, "driver_type", None) == "redis"
        db = (parts.path or "").strip("/")
        if redis_like and db and not db.isdigit():
            raise ConfigError(f"celery_ext: broker URL {shown}: the db (path) must be a "
                              f"number, got {db!r}")
